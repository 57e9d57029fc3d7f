"""Sol-RL and its baselines on Qwen-Image-Edit (image editing, 1024 px, the model card's 50 steps and guidance 4.0
against " "): `qwenimage_edit_<family>_<reward>` for the families diffusionnft, naive_scaling, compile, naive_quant,
sol_rl and the editing rewards `edit` (clip_direction:1.0,preserve:0.5), `clip_direction` and `vlm`, on the bundled
editing prompt set (edit/train, edit/test) unless told otherwise (solrl_engine/rl/presets.py says where each value
comes from; a prompt set of your own is JSON lines {"prompt": ..., "image": PATH}). Qwen-Image-Edit-2509 (and 2511):
`qwenimage_edit_plus_<family>_<reward>`, its model card's 40 steps, one or several sources a line
({"prompt": ..., "images": [PATH, ...]}, as many on every line; the rewards read the first).

    solrl train configs/qwenimage_edit.py:qwenimage_edit_sol_rl_edit --output runs/qwen-edit \\
        --set model_path=/w/qwen-image-edit --set reward_args=clip_direction.model=/w/clip-l \\
        --set train_prompts=/w/edits/train.jsonl --set eval_prompts=/w/edits/test.jsonl
"""

from solrl_engine.rl import presets

__all__ = presets.define_presets(globals(), "qwen-image-edit", "qwenimage_edit", presets.EDIT_REWARDS)
__all__ += presets.define_presets(globals(), "qwen-image-edit-2509", "qwenimage_edit_plus", presets.EDIT_REWARDS)
