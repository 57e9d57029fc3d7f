"""LoRA export in the diffusers/PEFT format, so the stock pipeline loads what was trained:

    pipe = StableDiffusion3Pipeline.from_pretrained(...)
    pipe.load_lora_weights("runs/mine/lora")        # the trained adapter
    pipe.load_lora_weights("runs/mine/lora_ema")    # or its EMA (what the evaluation samples with)

Written with the pipeline class's own `save_lora_weights`, with the adapter metadata (rank, alpha,
targets) so a loader does not assume alpha = rank. A two-expert model (Wan2.2-A14B) gets a file per trained expert:

    pipe.load_lora_weights("runs/mine/lora")   # the high-noise `transformer`'s, as above
    pipe.load_lora_weights("runs/mine/lora", weight_name="pytorch_lora_weights_transformer_2.safetensors",
                           load_into_transformer_2=True)   # the low-noise expert's

Each directory is written under a temporary name,
sealed with a MANIFEST.json (each file's size and SHA-256, every file fsynced) and renamed into
place, so a crash never leaves a half-written adapter where the last good one was and `solrl verify`
can tell a damaged copy from a good one (docs/checkpoints.md).

`load_lora` is how the engine reads an adapter back (`solrl eval --lora`, `solrl sample --lora`, your
own code): it checks the directory against its MANIFEST.json first and refuses a damaged one in one
line; `verify_adapter` is the same check for code that loads with diffusers itself
(`pipe.load_lora_weights`). An adapter without a manifest (diffusers' own exports) loads unchecked.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from solrl_engine.models import pipeline_class as resolve_pipeline_class
from solrl_engine.rl.adapters import TRAIN, LoraAdapters
from solrl_engine.rl.full import FullWeights, TrainedWeights
from solrl_engine.store.safe import default_mode, fresh_dir
from solrl_engine.store.sealed import MANIFEST, check_dir, commit, seal

WEIGHT_NAME = "pytorch_lora_weights.safetensors"
EXPERT = "transformer"  # the pipeline's name for its (first) denoiser


def expert_weight_name(expert: str) -> str:
    """The file of one expert's adapter: the (high-noise) `transformer`'s is diffusers' default name, which
    `pipe.load_lora_weights(DIR)` reads; a two-expert model's `transformer_2` has its own, which
    `pipe.load_lora_weights(DIR, weight_name=..., load_into_transformer_2=True)` reads."""
    return WEIGHT_NAME if expert == EXPERT else f"pytorch_lora_weights_{expert}.safetensors"


def adapter_files(directory: str | Path) -> dict[str, Path]:
    """The adapter files in `directory`, by the expert each is for ("transformer", and "transformer_2" for a
    two-expert model's low-noise expert)."""
    from solrl_engine.models.experts import EXPERTS

    found = {e: Path(directory) / expert_weight_name(e) for e in EXPERTS}
    return {e: f for e, f in found.items() if f.is_file()}


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
    tmp = fresh_dir(directory.with_name(f".tmp_{directory.name}"))  # a link left there is removed, not followed
    ctx = adapters.ema_weights() if ema else adapters.using(TRAIN)
    with ctx:
        state = get_peft_model_state_dict(adapters.transformer, adapter_name=TRAIN)
        state = {k: v.detach().float().cpu().clone() for k, v in state.items()}  # a copy: the context restores
    split = getattr(adapters.transformer, "split_lora", None)  # a two-expert model: a file per trained expert
    for expert, part in (split(state) if split is not None else {EXPERT: state}).items():
        resolve_pipeline_class(pipeline_class).save_lora_weights(
            tmp, transformer_lora_layers=part, weight_name=expert_weight_name(expert),
            transformer_lora_adapter_metadata=_metadata(adapters),
        )  # fmt: skip
    for name, text in (extra or {}).items():
        (tmp / name).write_text(text)
    for f in tmp.iterdir():  # safetensors' save_file writes the weights with mode 0o600
        os.chmod(f, default_mode())
    seal(tmp, {"kind": "lora", "adapter": "ema" if ema else "trained"})
    commit(tmp, directory)
    return directory


FULL_WEIGHT_NAME = "diffusion_pytorch_model.safetensors"  # what a diffusers model's from_pretrained reads


def save_full(
    weights: FullWeights, directory: str | Path, pipeline_class: str, ema: bool = False,
    extra: dict[str, str] | None = None, write: bool = True,
) -> Path:
    """Write the fully fine-tuned transformer (or its EMA) as a diffusers model directory, in the dtype its
    base weights were loaded in (what a user samples with), sealed like an adapter:

        transformer = SD3Transformer2DModel.from_pretrained("runs/mine/transformer_ema", torch_dtype=torch.bfloat16)
        pipe = StableDiffusion3Pipeline.from_pretrained(BASE, transformer=transformer)

    `pipeline_class` is accepted for the same call as `save_lora` (the directory is the transformer alone).
    Sharded (`weights.collective_io`), every rank calls it to gather the weights and only `write` ones write."""
    from safetensors.torch import save_file

    del pipeline_class
    directory = Path(directory)
    state = weights.export_state(ema=ema, keep=write)
    if not write:
        return directory
    tmp = directory.with_name(f".tmp_{directory.name}")
    fresh_dir(tmp)
    save_file(state, str(tmp / FULL_WEIGHT_NAME), metadata={"format": "pt"})
    weights.transformer.save_config(tmp)
    for name, text in (extra or {}).items():
        (tmp / name).write_text(text)
    for f in tmp.iterdir():
        os.chmod(f, default_mode())
    seal(tmp, {"kind": "transformer", "weights": "ema" if ema else "trained"})
    commit(tmp, directory)
    return directory


def save_trained(
    weights: TrainedWeights, directory: str | Path, pipeline_class: str, ema: bool = False,
    extra: dict[str, str] | None = None, write: bool = True,
) -> Path:
    """The run's trained weights as the stock pipeline loads them: a LoRA directory, or a whole transformer.
    Where saving gathers (`weights.collective_io`) every rank calls it, and those with `write` write."""
    if weights.kind == "full":
        return save_full(weights, directory, pipeline_class, ema=ema, extra=extra, write=write)  # type: ignore[arg-type]
    return save_lora(weights, directory, pipeline_class, ema=ema, extra=extra) if write else Path(directory)


def is_full_export(directory: str | Path) -> bool:
    """A directory written by `save_full` (a diffusers model directory) rather than a LoRA adapter."""
    return (Path(directory) / FULL_WEIGHT_NAME).is_file() and not (Path(directory) / WEIGHT_NAME).is_file()


def load_full(transformer: Any, directory: str | Path) -> None:
    """Load a full fine-tuning export into `transformer` in place (its own device and dtypes), after checking
    the directory against its manifest; names and shapes are checked before anything is written."""
    from safetensors.torch import load_file

    directory = Path(directory)
    if (directory / MANIFEST).exists():
        ok, detail = check_dir(directory)
        if not ok:
            raise DamagedAdapter(f"{directory} is damaged: {detail}; restore it from a copy (`--resume` writes a "
                                 "run's transformer/ and transformer_ema/ again)")  # fmt: skip
    try:
        state = load_file(str(directory / FULL_WEIGHT_NAME))
    except Exception as e:
        if type(e).__name__ != "SafetensorError" and not isinstance(e, OSError | EOFError):
            raise
        raise DamagedAdapter(f"{directory}: {FULL_WEIGHT_NAME} is unreadable ({type(e).__name__}); restore it from "
                             "a copy or export it again") from None  # fmt: skip
    own = transformer.state_dict()
    missing, extra = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or extra:
        raise ValueError(f"{directory} is not a transformer of this model: missing {missing[:3]}, unexpected "
                         f"{extra[:3]} (was it exported from another model or size?)")  # fmt: skip
    for k, v in state.items():
        if v.shape != own[k].shape:
            raise ValueError(f"{directory}: {k} has shape {tuple(v.shape)}, this model {tuple(own[k].shape)}")
    import torch

    with torch.no_grad():
        for k, v in state.items():
            own[k].copy_(v)


def load_trained(target: Any, directory: str | Path) -> str:
    """Load a run's export into a transformer: a LoRA adapter (`load_lora`) or a full fine-tuning's
    transformer (`load_full`); returns which ("lora" or "full")."""
    if is_full_export(directory):
        load_full(getattr(target, "transformer", target), directory)
        return "full"
    load_lora(target, directory)
    return "lora"


class DamagedAdapter(ValueError):
    """An exported adapter whose files do not match its MANIFEST.json, or that does not parse."""


def verify_adapter(directory: str | Path) -> bool:
    """Check an adapter directory against its MANIFEST.json: True when it verifies, False when it has no
    manifest (diffusers' own exports: nothing to check), DamagedAdapter naming what differs otherwise."""
    directory = Path(directory)
    if not adapter_files(directory):
        raise FileNotFoundError(f"{directory}: no {WEIGHT_NAME} there; pass a run's lora/, lora_ema/ or "
                                "lora_best/ directory (a full fine-tuning run's transformer*/ directories load with "
                                "load_trained or `solrl eval --lora`)")  # fmt: skip
    if not (directory / MANIFEST).exists():
        return False
    ok, detail = check_dir(directory)
    if not ok:
        raise DamagedAdapter(f"adapter {directory} is damaged: {detail}; restore it from a copy (`solrl verify RUN` "
                             "checks a whole run; `--resume` writes a run's lora/ and lora_ema/ again)")  # fmt: skip
    return True


def load_lora(target: Any, directory: str | Path, adapter_name: str = "lora") -> None:
    """Load an exported adapter into a diffusers transformer or pipeline, as `pipe.load_lora_weights`
    would, after `verify_adapter`: a damaged one is refused (DamagedAdapter) instead of sampling with
    altered weights, and one that does not parse is one line naming the file, not a SafetensorError."""
    directory = Path(directory)
    verify_adapter(directory)
    files = adapter_files(directory)
    experts = hasattr(target, "split_lora") or getattr(target, "transformer_2", None) is not None
    if set(files) != {EXPERT} and not experts:
        raise ValueError(f"adapter {directory} was trained on a two-expert model ({sorted(files)}: Wan2.2-A14B's "
                         f"experts) and {type(target).__name__} has one transformer: load it into the two-expert "
                         "pipeline it was trained on")  # fmt: skip
    try:
        if hasattr(target, "load_lora_weights"):  # a pipeline: each expert's file as diffusers loads it
            for expert, f in files.items():
                into = {"load_into_transformer_2": True} if expert != EXPERT else {}
                target.load_lora_weights(str(directory), weight_name=f.name, adapter_name=adapter_name, **into)
        elif hasattr(target, "split_lora"):  # a two-expert module (models/experts.py)
            target.load_lora_adapter(files, adapter_name=adapter_name, prefix=EXPERT)
        else:
            target.load_lora_adapter(str(directory), prefix=EXPERT, adapter_name=adapter_name,
                                     weight_name=WEIGHT_NAME)  # fmt: skip
    except Exception as e:  # safetensors' SafetensorError and whatever peft hits in a file that does not parse
        if type(e).__name__ != "SafetensorError" and not isinstance(e, OSError | EOFError):
            raise
        first = (str(e).splitlines() or [type(e).__name__])[0][:200]
        raise DamagedAdapter(f"adapter {directory}: {', '.join(f.name for f in files.values())} is unreadable "
                             f"({type(e).__name__}: {first}); restore it from a copy or export it again") from None
