"""Sol-RL and its baselines on Stable Diffusion 3.5 Large: `sd3_<family>_<reward>` for the five
families and the four rewards, with the paper's hyper-parameters (solrl_engine/rl/presets.py).

    solrl train configs/sd3.py:sd3_sol_rl_pickscore --set model_path=/w/sd35-large \\
        --set reward_args=pickscore.model=/w/pickscore,pickscore.processor=/w/clip-h
"""

from solrl_engine.rl.presets import define_presets

__all__ = define_presets(globals(), "sd3", "sd3")
