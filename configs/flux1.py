"""Sol-RL and its baselines on FLUX.1-dev (512 px): `flux1_<family>_<reward>` for the families
diffusionnft, naive_scaling, compile, naive_quant, sol_rl and the rewards imagereward, clipscore,
pickscore, hpsv2, hpsv3, ocr (text rendering, on the ocr prompt sets), vlm (a judge served by vLLM:
docs/real-models-and-rewards.md), with the paper's hyper-parameters
(solrl_engine/rl/presets.py).

    solrl train configs/flux1.py:flux1_sol_rl_hpsv2 --output runs/flux-hps --set model_path=/w/flux1-dev \\
        --set reward_args=hpsv2.model=/w/clip-h,hpsv2.checkpoint=/w/hps/HPS_v2.1_compressed.pt
    torchrun --nproc_per_node 8 --no-python solrl train configs/flux1.py:flux1_sol_rl_pickscore --output runs/flux \\
        --set model_path=/w/flux1-dev --set reward_args=pickscore.model=/w/pickscore,pickscore.processor=/w/clip-h
"""

from solrl_engine.rl import presets

__all__ = presets.define_presets(globals(), "flux", "flux1")
