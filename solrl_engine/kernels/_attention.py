"""What the explore pass's attention ops of every format share (explore_attention=<fmt>, the op
`solrl::<fmt>_attention`): the registration of its reference and Triton kernel behind the dispatch seam (the kernel
where Triton runs and the device has the format's tensor cores, for the head dims the kernels take) and the recorded
call. Each format's module keeps its own custom op (a torch.library registration is per op), its kernel call and its
numerics (quant/<fmt>.py's `attention`, the reference, looked up when it runs).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch

from solrl_engine.kernels._gemm import run_recorded
from solrl_engine.kernels.capability import tensor_cores
from solrl_engine.kernels.dispatch import choose, ran, register, run, unavailable_reason

MAX_HEAD_DIM = 256  # what the Triton attention kernels take: any head dim up to it (padded to a power of two)

Attention = Callable[..., torch.Tensor]  # (q, k, v, scale=None, key_bias=None) -> out


def register_attention(fmt: str, numerics: ModuleType, triton_impl: Attention, label: str) -> None:
    """Register `<fmt>_attention`: the reference (`numerics.attention`, read at each call) and the Triton kernel,
    which runs where Triton does on a device with `fmt`'s tensor cores and for head dims up to MAX_HEAD_DIM."""

    def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                  key_bias: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        ran("reference")
        return numerics.attention(q, k, v, scale, key_bias)

    def requires(device: torch.device) -> str | None:
        return unavailable_reason("triton", device) or tensor_cores(device, fmt)

    def fits(device: torch.device, d: int, **_: object) -> str | None:
        if d > MAX_HEAD_DIM:
            return f"the {label} attention kernel takes head dims up to {MAX_HEAD_DIM}; got {d}"
        return None

    register(f"{fmt}_attention", {"reference": reference, "triton": triton_impl}, requires={"triton": requires},
             fits={"triton": fits})  # fmt: skip


def run_attention(fmt: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None, tag: str,
                  key_bias: torch.Tensor | None, hint: str) -> torch.Tensor:  # fmt: skip
    """One call of `<fmt>_attention` through dispatch's choice for q's device and head dim, recorded under `tag`
    (`hint`: where the kernel runs, for the line a reference fallback logs)."""
    backend = choose(f"{fmt}_attention", q.device, d=q.shape[-1])[0]
    return run_recorded(tag, q, lambda: run(f"{fmt}_attention", backend, q, k, v, scale, key_bias), hint)
