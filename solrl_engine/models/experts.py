"""Two denoisers switched at a boundary timestep, as one module: Wan2.2's A14B models (a high-noise expert
`transformer` for timesteps >= boundary_ratio x 1000, a low-noise expert `transformer_2` below them), as
`WanPipeline` and `WanImageToVideoPipeline` sample them.

Why one module: the sampler, the explore copy, LoRA, the update, checkpoints and sharding all work on one
`model.transformer`. Here that module holds both experts under the pipeline's own names (`transformer.blocks.0...`,
`transformer_2.blocks.0...`), so the explore copy quantizes and refreshes both, a checkpoint holds both, and each
forward runs the expert the stock pipeline would run for its timestep. A batch whose rows have timesteps on both
sides of the boundary (the update's) is split by row and each part runs its own expert.

The switch reads the timestep on the host, which a captured CUDA graph would freeze: `capturable` is False and
rollouts sample eagerly (for a 14B video forward the launch overhead a graph removes is negligible).
`lora_experts` chooses which experts carry the trained LoRA (both, high or low); the other keeps its base weights.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

EXPERTS = ("transformer", "transformer_2")  # the pipeline's names: the high-noise expert, then the low-noise one
LORA_EXPERTS: dict[str, tuple[str, ...]] = {"both": EXPERTS, "high": EXPERTS[:1], "low": EXPERTS[1:]}


class TimestepExperts(nn.Module):
    """`transformer` (high noise) for timesteps >= `boundary`, `transformer_2` (low noise) below, in the timestep
    units the transformers take (boundary_ratio x num_train_timesteps); see the module docstring."""

    capturable = False  # the switch reads the timestep on the host

    def __init__(self, transformer: nn.Module, transformer_2: nn.Module, boundary: float,
                 lora_experts: str = "both") -> None:  # fmt: skip
        super().__init__()
        if lora_experts not in LORA_EXPERTS:
            raise ValueError(f"lora_experts={lora_experts!r}: choose one of {sorted(LORA_EXPERTS)} (which experts of a "
                             "two-expert model carry the trained LoRA)")  # fmt: skip
        self.transformer, self.transformer_2 = transformer, transformer_2
        self.boundary = float(boundary)
        self.trained = LORA_EXPERTS[lora_experts]

    def experts(self) -> dict[str, nn.Module]:
        return {name: getattr(self, name) for name in EXPERTS}

    # --- what diffusers' model API offers that the engine reads -------------------------------------------------

    @property
    def config(self) -> Any:
        """The high-noise expert's config: both experts share one architecture."""
        return self.transformer.config

    @property
    def _keep_in_fp32_modules(self) -> Any:
        return getattr(self.transformer, "_keep_in_fp32_modules", None)

    # --- the forward ------------------------------------------------------------------------------------------------

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor, **kwargs: Any) -> Any:
        """Each row through its expert (`return_dict=False` where rows split: the output is then a 1-tuple)."""
        ts = torch.as_tensor(timestep)
        if is_fake(ts):  # the memory plan's shapes-only forward: the experts share one architecture and one memory
            return self.transformer(hidden_states=hidden_states, timestep=timestep, **kwargs)
        high = ts.reshape(-1) >= self.boundary
        if bool(high.all()):
            return self.transformer(hidden_states=hidden_states, timestep=timestep, **kwargs)
        if not bool(high.any()):
            return self.transformer_2(hidden_states=hidden_states, timestep=timestep, **kwargs)
        b = hidden_states.shape[0]
        if high.numel() != b:
            raise ValueError(f"timestep of shape {tuple(ts.shape)} for a batch of {b}: give one timestep per row")
        out: torch.Tensor | None = None
        for expert, rows in ((self.transformer, high), (self.transformer_2, ~high)):
            idx = rows.nonzero().flatten()

            def part(v: Any, idx: torch.Tensor = idx) -> Any:
                return v[idx] if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == b else v

            got = expert(hidden_states=hidden_states[idx], timestep=ts.reshape(-1)[idx],
                         **{k: part(v) for k, v in kwargs.items()})[0]  # fmt: skip
            if out is None:
                out = got.new_empty((b, *got.shape[1:]))
            out[idx] = got
        return (out,)

    # --- LoRA: on the experts `lora_experts` names ------------------------------------------------------------------

    def add_adapter(self, config: Any, adapter_name: str = "default") -> None:
        for name in self.trained:
            getattr(self, name).add_adapter(config, adapter_name=adapter_name)

    def enable_adapters(self) -> None:
        for name in self.trained:
            getattr(self, name).enable_adapters()

    @property
    def peft_config(self) -> dict[str, Any]:
        return getattr(self, self.trained[0]).peft_config

    def split_lora(self, state: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
        """A LoRA state dict of this module (keys "transformer_2.blocks...") as one per trained expert, keyed by the
        pipeline's name for it, each with the keys its expert alone would have."""
        parts: dict[str, dict[str, torch.Tensor]] = {name: {} for name in self.trained}
        for key, value in state.items():
            name, _, rest = key.partition(".")
            if name not in parts:
                raise ValueError(f"LoRA weight {key!r} is on no trained expert of {sorted(parts)}")
            parts[name][rest] = value
        return parts

    def load_lora_adapter(self, files: dict[str, Path], adapter_name: str = "default", **kwargs: Any) -> None:
        """Each expert's adapter file (`files`: the pipeline's name for an expert -> its file) into that expert."""
        for name, path in files.items():
            getattr(self, name).load_lora_adapter(str(path.parent), weight_name=path.name, adapter_name=adapter_name,
                                                  **kwargs)  # fmt: skip

    # --- recompute in the backward: both experts ---------------------------------------------------------------------

    @property
    def gradient_checkpointing(self) -> bool:
        return any(getattr(e, "gradient_checkpointing", False) for e in self.experts().values())

    def enable_gradient_checkpointing(self, gradient_checkpointing_func: Callable[..., Any] | None = None) -> None:
        for e in self.experts().values():
            e.enable_gradient_checkpointing(gradient_checkpointing_func)

    def disable_gradient_checkpointing(self) -> None:
        for e in self.experts().values():
            e.disable_gradient_checkpointing()


def two_experts(pipe: Any, lora_experts: str = "both") -> TimestepExperts | None:
    """The experts of a two-expert pipeline (a `transformer_2` and a `boundary_ratio` in its config), as one module;
    None for a one-transformer pipeline, where `lora_experts` other than "both" is refused. A `transformer_2` without
    a boundary is never run by the stock pipeline, and is not here either."""
    low = getattr(pipe, "transformer_2", None)
    ratio = getattr(getattr(pipe, "config", None), "boundary_ratio", None) if low is not None else None
    if ratio is None:
        if lora_experts != "both":
            raise ValueError(f"lora_experts={lora_experts!r}: this pipeline has one transformer (no transformer_2 and "
                             "boundary_ratio, the Wan2.2-A14B layout): leave lora_experts at 'both'")  # fmt: skip
        return None
    if getattr(pipe, "transformer", None) is None:
        raise ValueError("this pipeline has a low-noise expert (transformer_2) but no high-noise one (transformer): "
                         "load both experts")  # fmt: skip
    steps = int(getattr(pipe.scheduler.config, "num_train_timesteps", 1000))
    return TimestepExperts(pipe.transformer, low, float(ratio) * steps, lora_experts)


def boundary_ratio(path: str | Path | None, by_hub: dict[str, float]) -> float | None:
    """A two-expert pipeline's boundary_ratio from its model_index.json (a local directory, the Hugging Face cache's
    copy) or, for a hub id not on this machine, `by_hub` (a family's published ones); None for one transformer or
    an unknown one. Read before any weight loads: the memory plan and the config's checks."""
    if not path:
        return None
    index: dict[str, Any] | None = None
    if (Path(path) / "model_index.json").is_file():
        index = json.loads((Path(path) / "model_index.json").read_text())
    else:
        with contextlib.suppress(Exception):
            from huggingface_hub import try_to_load_from_cache

            hit = try_to_load_from_cache(str(path), "model_index.json")
            if isinstance(hit, str):
                index = json.loads(Path(hit).read_text())
    if index is None:
        return by_hub.get(str(path))
    two = (index.get("transformer_2") or [None])[0] is not None and index.get("boundary_ratio") is not None
    return float(index["boundary_ratio"]) if two else None


class ExpertGuidance(float):
    """A two-expert model's classifier-free guidance: its value (a float, everywhere a scale is passed) is the
    high-noise expert's scale, and `at(t)` the scale of the expert that runs at flow time t (`guidance_scale_2` below
    the boundary), as WanPipeline applies `guidance_scale` and `guidance_scale_2`. Carried as a float so the one
    scale every sampler, objective and graph key passes needs no second argument; `guidance_at` reads it."""

    low: float
    boundary: float
    integer: bool

    def __new__(cls, high: float, low: float, boundary: float, integer: bool) -> ExpertGuidance:
        if (float(high) == 1.0) != (float(low) == 1.0):
            raise ValueError(f"guidance {high} for the high-noise expert and {low} for the low-noise one: both use "
                             "classifier-free guidance (!= 1) or neither does (1.0)")  # fmt: skip
        g = super().__new__(cls, high)
        g.low, g.boundary, g.integer = float(low), float(boundary), integer
        return g

    def __repr__(self) -> str:  # (a captured graph's key: another low-noise scale is another graph)
        return f"ExpertGuidance({float(self)!r}, {self.low!r}, boundary={self.boundary!r})"

    def __eq__(self, other: object) -> bool:
        """Two of them are equal when both experts' scales and the switch are; against a plain number, as the float
        it is (so `scale != 1.0`, "guidance on", reads the same for both)."""
        if isinstance(other, ExpertGuidance):
            return (float(self), self.low, self.boundary, self.integer) == (float(other), other.low, other.boundary,
                                                                          other.integer)  # fmt: skip
        return float(self) == other

    def __ne__(self, other: object) -> bool:
        return not self == other

    __hash__ = float.__hash__  # (equal to the plain float it equals: the contract holds; others may share a hash)

    def __reduce__(self) -> tuple[Any, tuple[float, float, float, bool]]:  # copy, deepcopy, pickle keep both scales
        return ExpertGuidance, (float(self), self.low, self.boundary, self.integer)

    def at(self, t: float | torch.Tensor) -> float | torch.Tensor:
        """The scale at flow time `t` (a host float: a float; a tensor of rows: one scale per row, shaped to
        broadcast over each row's velocity): the expert TimestepExperts runs there, by the same timestep."""
        ts = torch.as_tensor(t, dtype=torch.float32) * 1000.0  # (in FP32, as the model's timestep is computed)
        high = (ts.floor() if self.integer else ts) >= self.boundary
        if isinstance(t, torch.Tensor):
            return torch.where(high, float(self), self.low)
        return float(self) if bool(high) else self.low


def guidance_at(scale: float, t: float | torch.Tensor, like: torch.Tensor | None = None) -> float | torch.Tensor:
    """The guidance scale at flow time `t`: `scale` itself, or for an ExpertGuidance the running expert's; a per-row
    scale is shaped to broadcast over `like` (the velocity it multiplies)."""
    if not isinstance(scale, ExpertGuidance):
        return scale
    g = scale.at(t)
    if isinstance(g, torch.Tensor) and like is not None:
        g = g.to(like.device).reshape(-1, *([1] * (like.dim() - 1)))
    return g


def expert_guidance(model: Any, high: float, low: float) -> float:
    """`model`'s guidance with `low` for its low-noise expert (an ExpertGuidance; `high` alone where both are equal),
    switched where its experts switch. A model with one transformer is refused: guidance_scale_2 is a two-expert
    model's."""
    net = getattr(model, "transformer", None)
    if not isinstance(net, TimestepExperts):
        raise ValueError(f"guidance_scale_2 = {low} is the low-noise expert's scale of a two-expert model "
                         f"(Wan2.2-A14B); this {type(model).__name__} has one transformer: leave it unset")  # fmt: skip
    if float(low) == float(high):
        return float(high)
    return ExpertGuidance(high, low, net.boundary, bool(getattr(model, "integer_timesteps", False)))
