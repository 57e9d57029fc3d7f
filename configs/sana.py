"""Sol-RL and its baselines on SANA-1.6B (1024 px): `sana_<family>_<reward>` for the five families and
the four rewards, with the paper's hyper-parameters (solrl_engine/rl/presets.py).

    solrl train configs/sana.py:sana_sol_rl_imagereward --set model_path=/w/sana-1.6b \\
        --set reward_args=imagereward.model=/w/imagereward,imagereward.tokenizer=/w/bert-base-uncased
"""

from solrl_engine.rl.presets import define_presets

__all__ = define_presets(globals(), "sana", "sana")
