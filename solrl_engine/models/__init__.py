"""Model families behind one registry: every model presents the FlowModel interface (models/base.py).

Each family is one file holding a `SPEC` (a ModelSpec: its LoRA targets, the explore copy's
quantization rule, its default weights, resolution and guidance) and its adapter class (the
forward, the prompt encoding, the schedule, the decode); MODELS maps the family name to that file.
Adding a model is one new file plus one line here.

    model = load_model("sd3", "stabilityai/stable-diffusion-3.5-large", "cuda", torch.bfloat16)
    model = load_model("flux", "random")  # the published architecture, random weights, stand-in
                                          # text encoder and VAE: for speed benchmarks
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from solrl_engine.models.base import Conditioning, FlowModel
from solrl_engine.models.formats import rule_changes_by_format

# family name -> "module:attribute" of its ModelSpec
MODELS: dict[str, str] = {
    "tiny": "solrl_engine.models.tiny:SPEC",
    "sd3": "solrl_engine.models.sd3:SPEC",
    "flux": "solrl_engine.models.flux:SPEC",
    "sana": "solrl_engine.models.sana:SPEC",
    "wan": "solrl_engine.models.wan:SPEC",
    "qwenimage": "solrl_engine.models.qwenimage:SPEC",
    "sana_video": "solrl_engine.models.sana_video:SPEC",
    "z_image": "solrl_engine.models.z_image:SPEC",
    "flux2": "solrl_engine.models.flux2:SPEC",
    "flux_kontext": "solrl_engine.models.flux_kontext:SPEC",
    "qwenimage_edit": "solrl_engine.models.qwenimage_edit:SPEC",
    "qwenimage_edit_plus": "solrl_engine.models.qwenimage_edit_plus:SPEC",
    "wan_i2v": "solrl_engine.models.wan_i2v:SPEC",
}

# The benchmarks' names for the full-size published architectures (random weights).
ARCH_ALIASES: dict[str, str] = {"sd35-large": "sd3", "flux-dev": "flux", "sana-1.6b": "sana", "wan2.1-1.3b": "wan",
                                "wan2.1-14b": "wan", "qwen-image": "qwenimage", "qwen-image-edit": "qwenimage_edit",
                                "qwen-image-edit-2509": "qwenimage_edit_plus",
                                "sana-video-2b": "sana_video", "z-image": "z_image",
                                "flux2-klein-4b": "flux2", "wan2.1-i2v-14b": "wan_i2v"}  # fmt: skip


@dataclass(frozen=True)
class ModelSpec:
    """What the engine knows about one model (a model family: SD3.5, FLUX.1, SANA, the bundled one); the trainer
    reads it, never the model's name. (In code, "family" is the training method: RLConfig.family.)

    explore_rule: QuantRecipe changes for the explore copy (include patterns, extra skip patterns
        added to the recipe's defaults, skip_max_dim): the paper's layer choice for the family.
    explore_rule_by_format: changes on top of explore_rule for one explore format (a wider rule
        where an 8-bit format keeps the ranking: INT8 quantizes every eligible layer).
    guidance: "cfg" (classifier-free guidance against the empty prompt, in the sampler) or
        "embedded" (FLUX.1-dev's distilled guidance, an input of the transformer).
    pipeline: the diffusers pipeline class the weights load into (and LoRA exports load back into).
    repeated_blocks: the transformer's repeated block classes: the compiled sampler compiles each
        once and reuses it for every instance (regional compilation; diffusers declares this for
        FLUX only, as `_repeated_blocks`).
    producers: the explore copy's producers that emit their output's 8-bit codes (nn.producers): a module-name
        pattern -> the linears its output feeds, named from its parent (a block's norm1 -> attn.to_q, ...).
    producer_blocks: block class name -> the family's forward for it that hands its inline producers to nn.producers
        (a LayerNorm it modulates in its forward, through `modulate`: SANA, Wan, Qwen-Image, FLUX.2, FLUX.1's and
        SD3.5's FFN norms; an activation it joins to another output, through `activate_after`: FLUX.1's single
        block); the explore copy gives it to the blocks whose producers it fuses.
    conditioned: each prompt carries an image (a conditioned prompt set, solrl_engine/data): an editing family.
        A prompt set without images is refused for it before any weight loads, and one with images for the others.
    images_per_prompt: how many images each prompt of a conditioned family carries (None: any number, as many on
        every line: Qwen-Image-Edit-2509's sources); a set that differs is refused before any weight loads.
    capturable: False where the denoiser's forward reads values on the host (Z-Image: each prompt's token count,
        which sets its sequence and positions), which a CUDA graph would bake in: rollouts then sample without
        captured graphs (the compile family included; on a CPU inductor still compiles, breaking the graph there).
    pipeline_guidance_offset: the stock pipeline's `guidance_scale` is the engine's classifier-free guidance
        scale minus this (Z-Image's pipeline guides as v_c + g (v_c - v_u), which is the engine's v_u + s (v_c -
        v_u) at s = g + 1: offset 1); what a regeneration through the stock pipeline passes.
    two_experts: the family's pipelines may hold two experts switched at a boundary timestep (Wan2.2-A14B's
        `transformer_2` and `boundary_ratio`; models/experts.py), sampled and trained as one module.
    """

    name: str
    adapter: str  # "module:name": an adapter class (its .load) or a function: (path, device, dtype, **options)
    pipeline: str
    default_path: str | None
    resolution: int
    lora_targets: tuple[str, ...]
    explore_rule: dict[str, Any] = field(default_factory=dict)
    # Per-format changes on top of explore_rule, where a format is accurate enough for a wider rule than
    # NVFP4's: each format's default rule (models/formats/<fmt>.py, with its evidence), a family may override.
    explore_rule_by_format: dict[str, dict[str, Any]] = field(default_factory=rule_changes_by_format)
    guidance: str = "cfg"
    guidance_scale: float = 1.0
    repeated_blocks: tuple[str, ...] = ()
    producers: dict[str, tuple[str, ...]] = field(default_factory=dict)
    producer_blocks: dict[str, Callable[..., Any]] = field(default_factory=dict)
    video: bool = False  # decode gives videos [B, F, 3, H, W]; the config's `frames` and `width` apply
    capturable: bool = True
    pipeline_guidance_offset: float = 0.0
    conditioned: bool = False
    images_per_prompt: int | None = 1
    resolution_step: int = 1  # the config's resolution must be a multiple of it (refused at validation, no weights)
    two_experts: bool = False  # its pipelines may hold two experts (Wan2.2-A14B): the config's lora_experts applies
    # published parameter counts (billions) of the default weights' text encoders and VAE: the memory plan's
    # (rl/memplan.py) and bench/memory.py's, where nothing is loaded
    text_encoder_params_b: dict[str, float] = field(default_factory=dict)
    vae_params_b: float = 0.0

    def build(self, path: str | Path | None, device: torch.device | str, dtype: torch.dtype, **options: Any
              ) -> FlowModel:  # fmt: skip
        obj = self.adapter_object()
        return getattr(obj, "load", obj)(path, device=device, dtype=dtype, **options)

    def adapter_object(self) -> Any:
        mod, attr = self.adapter.split(":")
        return getattr(importlib.import_module(mod), attr)


def model_spec(name: str) -> ModelSpec:
    """The spec of family `name` (see MODELS); a clear error naming the families otherwise."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; available: {sorted(MODELS)}")
    mod, attr = MODELS[name].split(":")
    return getattr(importlib.import_module(mod), attr)


def load_model(
    name: str,
    path: str | Path | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    **options: Any,
) -> FlowModel:
    """A model by family name; `path` is a local pipeline directory, a hub id, or "random" (the
    family's published architecture with random weights, for benchmarks). `options` go to the
    family's adapter (resolution, guidance_scale, offload_text_encoders, decode_batch_size, ...)."""
    if name in ARCH_ALIASES:  # the benchmarks' full-size architectures
        name, path = ARCH_ALIASES[name], path or "random"
    spec = model_spec(name)
    return spec.build(path if path is not None else spec.default_path, device, dtype, **options)


def pipeline_class(name: str, missing_ok: bool = False) -> Any:
    """diffusers' pipeline class `name` (None for an unknown name with `missing_ok`), imported with
    transformers' warnings off: importing a pipeline module imports image processors it may use
    (SD3's IP-adapter SigLIP, CLIP), and without torchvision (CPU installs) transformers warns about
    their fallback, mid progress bar, although resolving the class never uses them."""
    import diffusers
    from transformers.utils import logging as tlog

    level = tlog.get_verbosity()
    tlog.set_verbosity_error()
    try:
        return getattr(diffusers, name, None) if missing_ok else getattr(diffusers, name)
    finally:
        tlog.set_verbosity(level)


def wrap_pipeline(
    pipe: Any, resolution: int | None = None, guidance_scale: float | None = None, decode_batch_size: int = 8,
    **options: Any,
) -> tuple[FlowModel, str]:
    """(FlowModel, its name in MODELS) over a caller's stock diffusers pipeline (or a FlowModel of ours, passed
    through), on the pipeline's own device and dtype and without moving anything: the caller keeps
    the pipeline as it was."""
    if getattr(pipe, "MODEL", "") in MODELS and hasattr(pipe, "velocity"):
        return pipe, pipe.MODEL
    if getattr(pipe, "FAMILY", "") in MODELS and hasattr(pipe, "velocity"):  # the attribute's older name
        warnings.warn(f"{type(pipe).__name__}.FAMILY is now called MODEL (its name in solrl_engine.models.MODELS); "
                      "rename the attribute", DeprecationWarning, stacklevel=2)  # fmt: skip
        return pipe, pipe.FAMILY
    for name in MODELS:
        spec = model_spec(name)
        cls = pipeline_class(spec.pipeline, missing_ok=True)
        if name != "tiny" and cls is not None and isinstance(pipe, cls):
            adapter = spec.adapter_object()
            p = next(pipe.transformer.parameters())
            if resolution is None:  # the pipeline's own default size, as pipe(prompt) would draw
                resolution = adapter.pipeline_resolution(pipe)
            model = adapter(pipe, device=p.device, dtype=p.dtype, resolution=resolution, offload_text_encoders=False,
                            decode_batch_size=decode_batch_size, guidance_scale=guidance_scale, place=False,
                            **options)  # fmt: skip
            return model, name
    known = [model_spec(n).pipeline for n in MODELS if n != "tiny"]
    raise TypeError(f"{type(pipe).__name__} is not a pipeline this engine knows; pass one of {known} or a FlowModel")


__all__ = [
    "ARCH_ALIASES",
    "Conditioning",
    "FlowModel",
    "MODELS",
    "ModelSpec",
    "load_model",
    "model_spec",
    "pipeline_class",
    "wrap_pipeline",
]
