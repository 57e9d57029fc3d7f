"""LoRA export in the diffusers/PEFT format, so the stock pipeline loads what was trained:

    pipe = StableDiffusion3Pipeline.from_pretrained(...)
    pipe.load_lora_weights("runs/mine/lora")        # the trained adapter
    pipe.load_lora_weights("runs/mine/lora_ema")    # or its EMA (what the evaluation samples with)

Written with the pipeline class's own `save_lora_weights`, with the adapter metadata (rank, alpha,
targets) so a loader does not assume alpha = rank. Each directory is written under a temporary name,
sealed with a MANIFEST.json (each file's size and SHA-256, every file fsynced) and renamed into
place, so a crash never leaves a half-written adapter where the last good one was and `solrl verify`
can tell a damaged copy from a good one (docs/checkpoints.md).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from solrl_engine.models import pipeline_class as resolve_pipeline_class
from solrl_engine.rl.adapters import TRAIN, LoraAdapters
from solrl_engine.rl.sealed import commit, seal

WEIGHT_NAME = "pytorch_lora_weights.safetensors"


def _metadata(adapters: LoraAdapters) -> dict:
    cfg = adapters.transformer.peft_config[TRAIN].to_dict()
    for k, v in list(cfg.items()):
        if isinstance(v, set):
            cfg[k] = sorted(v)
    return cfg


def save_lora(
    adapters: LoraAdapters, directory: str | Path, pipeline_class: str, ema: bool = False,
    extra: dict[str, str] | None = None,
) -> Path:  # fmt: skip
    """Write the trained adapter (or its EMA with `ema=True`) as a diffusers LoRA directory; `extra`
    files (name: text) go in with it, under the same manifest, so they appear together or not at all."""
    from peft import get_peft_model_state_dict

    directory = Path(directory)
    tmp = directory.with_name(f".tmp_{directory.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    ctx = adapters.ema_weights() if ema else adapters.using(TRAIN)
    with ctx:
        state = get_peft_model_state_dict(adapters.transformer, adapter_name=TRAIN)
        state = {k: v.detach().float().cpu().clone() for k, v in state.items()}  # a copy: the context restores
    resolve_pipeline_class(pipeline_class).save_lora_weights(
        tmp, transformer_lora_layers=state, weight_name=WEIGHT_NAME,
        transformer_lora_adapter_metadata=_metadata(adapters),
    )  # fmt: skip
    for name, text in (extra or {}).items():
        (tmp / name).write_text(text)
    seal(tmp, {"kind": "lora", "adapter": "ema" if ema else "trained"})
    commit(tmp, directory)
    return directory
