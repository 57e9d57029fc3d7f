"""Sol-RL and its baselines on Z-Image (6B single-stream DiT, 1024 px, the model card's 50 steps and guidance 4.0,
5.0 in the engine's convention): `z_image_<family>_<reward>` for the families diffusionnft, naive_scaling, compile,
naive_quant, sol_rl and the rewards imagereward, clipscore, pickscore, hpsv2, hpsv3, ocr, vlm
(solrl_engine/rl/presets.py says where each value comes from).

    solrl train configs/z_image.py:z_image_sol_rl_pickscore --output runs/z-image --set model_path=/w/z-image \\
        --set reward_args=pickscore.model=/w/pickscore,pickscore.processor=/w/clip-h \\
        --set prompts_per_iter=8 --set full_steps=20 --set preview_steps=12
"""

from solrl_engine.rl import presets

__all__ = presets.define_presets(globals(), "z-image", "z_image")
