"""What a CUDA-graph capture can hold, checked without a GPU.

A captured region may read only device memory that exists before capture, and must never wait for the
host. On CUDA, a host-to-device copy inside capture fails (or, for a 0-dim CPU tensor fed to a kernel,
its value is baked into the graph and goes stale on replay); `.item()`, `float(t)`, `bool(t)` and
`nonzero` synchronize and fail; a CPU tensor created inside the region is one of those. A lent GPU is
too rare to find these by trying, so `CaptureGuard` rehearses a capture: the region runs on a device
of the caller's choice (the meta device in tests: shapes only, no kernels, no autocast) and every op
that a capture on that device could not hold is recorded with the line of code that called it.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

# ops whose result the host must read (a device sync): never inside a capture
HOST_SYNC_OPS = frozenset({
    "aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::unique", "aten::_unique2",
    "aten::unique_consecutive", "aten::unique_dim", "aten::repeat_interleave", "aten::equal", "aten::is_nonzero",
})  # fmt: skip
COPY_OPS = frozenset({"aten::_to_copy", "aten::copy_", "aten::to", "aten::lift_fresh_copy"})
_SKIP = (str(Path(torch.__file__).parent), str(Path(__file__)))


@dataclass(frozen=True)
class Violation:
    """One op a capture could not hold: `kind` is "host sync", "host-to-device copy" or "host tensor"."""

    kind: str
    op: str
    detail: str
    where: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.op} ({self.detail}) at {self.where}"


class CaptureViolation(RuntimeError):
    """A captured region did what a CUDA graph cannot hold (raised at a host sync, whose value is needed)."""


def _caller() -> str:
    """The innermost frame outside torch and this file: the line that asked for the op."""
    for fr in reversed(traceback.extract_stack()):
        if not fr.filename.startswith(_SKIP):
            return f"{fr.filename}:{fr.lineno} in {fr.name}"
    return "?"


class CaptureGuard(TorchDispatchMode):
    """Records every op of the region that a capture on `device` could not hold: a host sync (raises
    CaptureViolation, the host would need the value), a copy from another device into it, any tensor of
    another device (the CPU) used by an op. A foreign tensor is moved to `device` after being recorded, so
    one rehearsal lists all of them."""

    def __init__(self, device: torch.device | str) -> None:
        super().__init__()
        self.device = torch.device(device)
        self.violations: list[Violation] = []

    def _foreign(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and t.device != self.device

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        op = func._schema.name
        if op in HOST_SYNC_OPS:
            v = Violation("host sync", op, "the host reads a device value", _caller())
            self.violations.append(v)
            raise CaptureViolation(str(v))
        foreign = [t for t in tree_leaves((args, kwargs)) if self._foreign(t)]
        if foreign:
            t = foreign[0]
            kind = "host-to-device copy" if op in COPY_OPS else "host tensor"
            what = f"{t.device.type} tensor of shape {tuple(t.shape)}, {str(t.dtype).removeprefix('torch.')}"
            self.violations.append(Violation(kind, op, what, _caller()))
            args, kwargs = tree_map(lambda a: a.to(self.device) if self._foreign(a) else a, (args, kwargs))
        return func(*args, **kwargs)


def rehearse_capture(fn: Callable[[], Any], device: torch.device | str = "meta") -> list[Violation]:
    """Run `fn` (a region that would be captured, its tensors on `device`) under CaptureGuard; the
    violations, empty when a CUDA graph could hold the region."""
    guard = CaptureGuard(device)
    try:
        with torch.no_grad(), guard:
            fn()
    except CaptureViolation:
        pass  # recorded: a host sync stops the region, as it would stop a capture
    return guard.violations


def check_capture(fn: Callable[[], Any], device: torch.device | str = "meta", what: str = "the captured region"
                  ) -> None:  # fmt: skip
    """rehearse_capture, raising CaptureViolation listing every violation (each with its line of code)."""
    found = rehearse_capture(fn, device)
    if found:
        lines = "\n  ".join(str(v) for v in found)
        raise CaptureViolation(f"{what} cannot be captured in a CUDA graph:\n  {lines}")
