"""Sol-RL and its baselines on Qwen-Image (20B MMDiT, 1328 px, the model card's 50 steps and guidance 4.0):
`qwenimage_<family>_<reward>` for the families diffusionnft, naive_scaling, compile, naive_quant, sol_rl and the
rewards imagereward, clipscore, pickscore, hpsv2, hpsv3, ocr, vlm (solrl_engine/rl/presets.py says where each value
comes from).

    solrl train configs/qwenimage.py:qwenimage_sol_rl_pickscore --output runs/qwen --set model_path=/w/qwen-image \\
        --set reward_args=pickscore.model=/w/pickscore,pickscore.processor=/w/clip-h \\
        --set prompts_per_iter=8 --set full_steps=20 --set preview_steps=12
"""

from solrl_engine.rl import presets

__all__ = presets.define_presets(globals(), "qwenimage", "qwenimage")
