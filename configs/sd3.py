"""Sol-RL and its baselines on Stable Diffusion 3.5 Large (1024 px): `sd3_<family>_<reward>` for the
families diffusionnft, naive_scaling, compile, naive_quant, sol_rl and the rewards imagereward,
clipscore, pickscore, hpsv2, hpsv3, ocr (text rendering, on the ocr prompt sets), vlm (a judge served by vLLM:
docs/real-models-and-rewards.md), with the paper's hyper-parameters
(solrl_engine/rl/presets.py).

    solrl train configs/sd3.py:sd3_sol_rl_pickscore --output runs/sd3-pickscore --set model_path=/w/sd35-large \\
        --set reward_args=pickscore.model=/w/pickscore,pickscore.processor=/w/clip-h
    solrl train configs/sd3.py:sd3_diffusionnft_pickscore --output runs/sd3-nft --set model_path=/w/sd35-large \\
        --set train_prompts=/data/pickscore:train --set eval_prompts=/data/pickscore:test
"""

from solrl_engine.rl import presets

__all__ = presets.define_presets(globals(), "sd3", "sd3")
