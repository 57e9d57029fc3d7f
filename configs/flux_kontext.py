"""Sol-RL and its baselines on FLUX.1 Kontext [dev] (image editing, 1024 px, the pipeline's 28 steps at distilled
guidance 2.5): `flux_kontext_<family>_<reward>` for the families diffusionnft, naive_scaling, compile, naive_quant,
sol_rl and the editing rewards `edit` (clip_direction:1.0,preserve:0.5), `clip_direction` and `vlm`, on the bundled
editing prompt set (edit/train, edit/test) unless told otherwise (solrl_engine/rl/presets.py says where each value
comes from; a prompt set of your own is JSON lines {"prompt": ..., "image": PATH}).

    solrl train configs/flux_kontext.py:flux_kontext_sol_rl_edit --output runs/kontext \\
        --set model_path=/w/flux-kontext --set reward_args=clip_direction.model=/w/clip-l \\
        --set train_prompts=/w/edits/train.jsonl --set eval_prompts=/w/edits/test.jsonl
"""

from solrl_engine.rl import presets

__all__ = presets.define_presets(globals(), "flux-kontext", "flux_kontext", presets.EDIT_REWARDS)
