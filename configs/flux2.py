"""Sol-RL and its baselines on FLUX.2 [klein] base 4B (1024 px, the pipeline's documented 50 steps and guidance
4.0): `flux2_klein_<family>_<reward>` for the families diffusionnft, naive_scaling, compile, naive_quant, sol_rl and
the rewards imagereward, clipscore, pickscore, hpsv2, hpsv3, ocr, vlm (solrl_engine/rl/presets.py says where each
value comes from). The 9B base loads the same way (`--set model_path=black-forest-labs/FLUX.2-klein-base-9B`).

    solrl train configs/flux2.py:flux2_klein_sol_rl_pickscore --output runs/flux2 --set model_path=/w/flux2-klein \\
        --set reward_args=pickscore.model=/w/pickscore,pickscore.processor=/w/clip-h \\
        --set prompts_per_iter=8 --set full_steps=20 --set preview_steps=12
"""

from solrl_engine.rl import presets

__all__ = presets.define_presets(globals(), "flux2-klein", "flux2_klein")
