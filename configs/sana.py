"""Sol-RL and its baselines on SANA-1.6B (1024 px): `sana_<family>_<reward>` for the families
diffusionnft, naive_scaling, compile, naive_quant, sol_rl and the rewards imagereward, clipscore,
pickscore, hpsv2, hpsv3, ocr (text rendering, on the ocr prompt sets), vlm (a judge served by vLLM:
docs/real-models-and-rewards.md), with the paper's hyper-parameters
(solrl_engine/rl/presets.py).

    solrl train configs/sana.py:sana_sol_rl_imagereward --output runs/sana-ir --set model_path=/w/sana-1.6b \\
        --set reward_args=imagereward.model=/w/imagereward,imagereward.tokenizer=/w/bert-base-uncased
    solrl train configs/sana.py:sana_naive_quant_clipscore --output runs/sana-nq --set model_path=/w/sana-1.6b \\
        --set reward_args=clipscore.model=/w/clip-l --set iterations=100
"""

from solrl_engine.rl import presets

__all__ = presets.define_presets(globals(), "sana", "sana")
