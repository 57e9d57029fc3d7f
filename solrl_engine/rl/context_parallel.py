"""Context parallelism: each forward's sequence split over a group of ranks, through diffusers' own hooks.

    torchrun --nproc_per_node 8 --no-python solrl train configs/wan.py:wan14b_sol_rl_clipscore \\
        --set context_parallel=2 --set sharding=fsdp

A 480 x 832, 81-frame clip is 32,760 tokens: its update's activations, not its weights, are what keep a 14B video
model off one GPU. With `context_parallel=N`, groups of N consecutive ranks hold the same samples (the data splits
over the world / N groups: rl/distributed.py's dp_rank and dp_world) and every transformer forward of the group
splits its tokens N ways: diffusers' context-parallel plan for the model (`_cp_plan`: where the sequence is split
and gathered) and its attention dispatch, Ulysses (an all-to-all that gives each rank every token of 1/N of the
heads) or ring attention (the keys and values passed around the group, each rank's queries attending to all; it
needs an attention kernel that returns the log-sum-exp, so a GPU one). `context_parallel_mode=auto` takes Ulysses
where N divides the heads, ring otherwise.

What the engine adds behind this seam: the mesh (data, ring, ulysses) over the world, so a group is N consecutive
ranks; the same split on the policy, its explore copy and its merged copy, and on both experts of a two-expert
model; and the config set up with this rank's own device, since diffusers takes `rank % accelerator count`, which
is a division by zero on a CPU (gloo), where the tests run it. The gradients need nothing more: the output is
gathered whole on every rank of a group, so each rank's backward gives the weights its part of the sequence's
gradient, and the sum over every rank the trainer already takes is the whole one (tests/test_context_parallel.py:
2 gloo ranks with Ulysses equal one process).
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import torch
from torch import nn

log = logging.getLogger("solrl_engine.rl")

CP_MODES = ("auto", "ulysses", "ring")


def _denoisers(transformer: nn.Module) -> list[nn.Module]:
    """The diffusers models inside: a two-expert model's experts (models/experts.py), else the module itself."""
    experts = getattr(transformer, "experts", None)
    return list(experts().values()) if callable(experts) else [transformer]


def resolve_mode(transformer: nn.Module, degree: int, mode: str, device: torch.device, tokens: int | None) -> str:
    """The split `mode` resolves to for this model, or a ValueError naming what does not divide and the fix."""
    net = _denoisers(transformer)[0]
    if getattr(net, "_cp_plan", None) is None:
        raise ValueError(f"context_parallel={degree}: diffusers has no context-parallel plan (`_cp_plan`) for "
                         f"{type(net).__name__}; leave context_parallel at 1 for this model")  # fmt: skip
    heads = int(getattr(net.config, "num_attention_heads", 0) or 0)
    if mode == "auto":
        mode = "ulysses" if heads and heads % degree == 0 else "ring"
    if mode == "ulysses" and (not heads or heads % degree):
        raise ValueError(f"context_parallel={degree} with Ulysses splits the attention heads, and {heads} heads "
                         "do not divide by it: pick a degree that divides them, or context_parallel_mode=ring")
    if mode == "ring" and device.type != "cuda":
        raise ValueError(f"context_parallel_mode=ring needs an attention kernel that returns the log-sum-exp (cuDNN, "
                         f"flash), which a {device.type} does not have: use context_parallel_mode=ulysses")  # fmt: skip
    if tokens is not None and tokens % degree:
        raise ValueError(f"context_parallel={degree}: a sample's {tokens} tokens do not split evenly {degree} ways; "
                         "change the frames or the size, or the degree")  # fmt: skip
    return mode


def split_context(modules: list[nn.Module], dist: Any, degree: int, mode: str, device: torch.device) -> Any:
    """Apply the split to each of `modules` (the policy and its copies; each may hold two experts) over groups of
    `degree` consecutive ranks of `dist`; returns the device mesh (data, ring, ulysses)."""
    from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig
    from torch.distributed.device_mesh import init_device_mesh

    # diffusers' gather calls a collective torch has renamed, which warns at every forward
    warnings.filterwarnings("ignore", message=".*all_gather_tensor.* is deprecated", category=FutureWarning)
    ring, ulysses = (degree, 1) if mode == "ring" else (1, degree)
    mesh = init_device_mesh(device.type, (dist.world // degree, ring, ulysses),
                            mesh_dim_names=("data", "ring", "ulysses"))  # fmt: skip
    for module in modules:
        for net in _denoisers(module):
            if mode == "ring":  # an attention kernel that returns the log-sum-exp the ring merges with
                net.set_attention_backend("_native_cudnn")
            config = ParallelConfig(context_parallel_config=ContextParallelConfig(ring_degree=ring,
                                                                                  ulysses_degree=ulysses, mesh=mesh))
            config.setup(dist.rank, dist.world, device, mesh=mesh)

            def resolved(_config: Any, net: nn.Module = net, config: Any = config) -> Any:
                net._parallel_config = config  # what diffusers' own set-up records
                return config

            net._resolve_parallel_config = resolved  # this rank's device, not rank % accelerator count
            with _quiet_diffusers():  # its "experimental feature" warning, once per module and rank
                net.enable_parallelism(config=config.context_parallel_config)
    log.info("context_parallel=%d (%s): each forward's tokens split over groups of %d ranks, the data over %d groups",
             degree, mode, degree, dist.world // degree)  # fmt: skip
    _report_first_split(_denoisers(modules[0])[0])
    return mesh


def _report_first_split(net: nn.Module) -> None:
    """Log, once, the tokens the first attention of `net` sees on this rank: what the split did, not what it was
    asked to do."""
    from diffusers.models.attention import AttentionModuleMixin
    from diffusers.models.attention_processor import Attention

    attn = next((m for m in net.modules() if isinstance(m, AttentionModuleMixin | Attention)), None)
    if attn is None:
        return
    handle: Any = None

    def seen(module: nn.Module, args: tuple, kwargs: dict) -> None:
        x = kwargs.get("hidden_states", args[0] if args else None)
        if isinstance(x, torch.Tensor) and x.dim() == 3:
            log.info("context_parallel: the first attention saw %d tokens a sample on this rank", x.shape[1])
        handle.remove()

    handle = attn.register_forward_pre_hook(seen, with_kwargs=True)


class _quiet_diffusers:
    def __enter__(self) -> None:
        from diffusers.utils import logging as dlog

        self._level = dlog.get_verbosity()
        dlog.set_verbosity_error()

    def __exit__(self, *exc: object) -> None:
        from diffusers.utils import logging as dlog

        dlog.set_verbosity(self._level)
