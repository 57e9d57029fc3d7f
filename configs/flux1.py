"""Sol-RL and its baselines on FLUX.1-dev: `flux1_<family>_<reward>` for the five families and the
four rewards, with the paper's hyper-parameters (solrl_engine/rl/presets.py).

    solrl train configs/flux1.py:flux1_sol_rl_hpsv2 --set model_path=/w/flux1-dev \\
        --set reward_args=hpsv2.model=/w/clip-h,hpsv2.checkpoint=/w/HPS_v2.1_compressed.pt
"""

from solrl_engine.rl.presets import define_presets

__all__ = define_presets(globals(), "flux", "flux1")
