"""The one place that chooses an implementation (reference | triton | cuda) for an op.

Default: on a CUDA tensor the `cuda` implementation if it can run (the compiled extension's kernel,
or for GEMMs torch's own cuBLASLt `_scaled_mm` where the GPU has the tensor cores for it), else
Triton, else the reference; on anything else the reference. `SOLRL_BACKEND=reference|triton|cuda|cutlass` asks for one
backend; when it cannot serve an op on a device, the call falls back to the default and says so once
in the log, never silently wrong.

What actually ran is recorded too (`record_run` / `runs`): each quantized layer's GEMM names the
implementation that computed its last call, so a layer that lands on the slow reference on a GPU is
reported (and warned about once), not assumed fast from what was chosen at quantize time.

`SOLRL_SIMULATE_SM=90` (a test switch) makes dispatch treat the CPU as a GPU of that compute
capability wherever the fast op has a CPU implementation (`torch._scaled_mm`, `torch._int_mm`, Triton
under TRITON_INTERPRET=1): the GPU's choices and paths then run, and are checked, on a CPU (see
`capability`, which also holds the tensor-core table the GEMMs' availability checks read).
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from solrl_engine.kernels.capability import SIM_ENV as SIM_ENV  # re-exported: their home was here
from solrl_engine.kernels.capability import device_capability as device_capability
from solrl_engine.kernels.capability import gpu_like
from solrl_engine.kernels.capability import simulated_capability as simulated_capability

# cutlass: the extension's CUTLASS sm100 block-scaled GEMM, asked for by name only (SOLRL_BACKEND=cutlass)
# until it has run on a Blackwell GPU; ops without a cutlass implementation take their default.
BACKENDS: tuple[str, ...] = ("reference", "triton", "cuda", "cutlass")
ENV_VAR = "SOLRL_BACKEND"
log = logging.getLogger("solrl_engine.kernels")


@functools.cache
def _import(name: str) -> ModuleType | str:
    """The module, or the reason it cannot be imported (cached: imports are tried once)."""
    try:
        return importlib.import_module(name)
    except Exception as e:  # noqa: BLE001 - any import failure means "unavailable", with its reason
        return f"{type(e).__name__}: {e}"


TRITON_PACKAGE = "solrl_triton"


@functools.cache
def source_tree_kernels() -> str | None:
    """Make the repository's triton_kernels/ folder importable as `solrl_triton` when the project is run
    from a checkout without being installed (a lent GPU machine runs a bare copy with PYTHONPATH=.):
    setup.py's package_dir gives it that name only on install. Returns where `solrl_triton` comes from,
    or None when neither an installed package nor the folder beside solrl_engine/ exists."""
    import importlib.util
    import sys
    from pathlib import Path

    if TRITON_PACKAGE in sys.modules:
        return getattr(sys.modules[TRITON_PACKAGE], "__file__", None)
    spec = importlib.util.find_spec(TRITON_PACKAGE)
    if spec is not None:
        return spec.origin
    folder = Path(__file__).resolve().parents[2] / "triton_kernels"
    if not (folder / "__init__.py").is_file():
        return None
    spec = importlib.util.spec_from_file_location(TRITON_PACKAGE, folder / "__init__.py",
                                                  submodule_search_locations=[str(folder)])  # fmt: skip
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[TRITON_PACKAGE] = mod  # before exec: the package's relative imports find it
    try:
        spec.loader.exec_module(mod)  # type: ignore[union-attr]
    except BaseException:
        sys.modules.pop(TRITON_PACKAGE, None)  # a half-built package must not pass for a loaded one
        raise
    return spec.origin


def _triton_unavailable() -> str | None:
    """None when our Triton kernels import, else why not and what to do (Triton missing, or the kernels
    neither installed nor beside solrl_engine/ in a checkout)."""
    mod = _import("triton")
    if isinstance(mod, str):
        return f"Triton is not installed ({mod}); pip install triton"
    try:
        where = source_tree_kernels()
    except Exception as e:  # noqa: BLE001 - the folder is there but does not import: say why
        return f"the Triton kernels beside solrl_engine/ do not import ({type(e).__name__}: {e})"
    if where is None:
        return (f"the Triton kernels ({TRITON_PACKAGE}) are not installed and no triton_kernels/ folder lies beside "
                "solrl_engine/: pip install -e . from the repository")  # fmt: skip
    mod = _import(TRITON_PACKAGE)
    if isinstance(mod, str):
        return f"the Triton kernels do not import ({mod})"
    return None


def triton_module(name: str) -> ModuleType:
    """Import solrl_triton.<name>, the repository's triton_kernels/ folder (lazily: Triton is an
    optional dependency). It is installed under that name, not as `triton_kernels`: the Triton project
    ships a package of that name (imported by vLLM and SGLang), and one would shadow the other. From a
    checkout that is not installed, the folder is loaded under that name (source_tree_kernels)."""
    why = _triton_unavailable()
    if why is not None:
        raise ImportError(f"Triton kernels unavailable: {why}")
    mod = _import(f"{TRITON_PACKAGE}.{name}")
    if isinstance(mod, str):
        raise ImportError(f"Triton kernel module {TRITON_PACKAGE}.{name} does not import: {mod}")
    return mod


@functools.cache
def cuda_extension() -> Any | None:
    """The compiled extension's ops (torch.ops.solrl_C, registered with the dispatcher when
    solrl_engine._C is imported), or None when it was not built."""
    mod = _import("solrl_engine._C")
    if isinstance(mod, str):
        return None
    _register_fakes()
    return torch.ops.solrl_C


def _register_fakes() -> None:
    """Shapes of the extension's ops for torch.compile's tracing (no kernel runs)."""

    @torch.library.register_fake("solrl_C::nvfp4_quantize")
    def _(x, amax, swizzle, stream):  # noqa: ANN001, ANN202 - shape function
        rows, cols = (x.numel() // x.shape[-1] if x.shape[-1] else 0), x.shape[-1]
        q = x.new_empty((*x.shape[:-1], cols // 2), dtype=torch.uint8)
        if swizzle:
            s = x.new_empty(((rows + 127) // 128 * 128 * ((cols // 16 + 3) // 4 * 4),), dtype=torch.uint8)
        else:
            s = x.new_empty((*x.shape[:-1], cols // 16), dtype=torch.uint8)
        return [q, s, x.new_empty((), dtype=torch.float32)]

    @torch.library.register_fake("solrl_C::nvfp4_gemm_sm100")
    def _(a, sfa, b, sfb, alpha, bias, stream):  # noqa: ANN001, ANN202 - shape function
        return a.new_empty((a.shape[0], b.shape[0]), dtype=torch.bfloat16)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def unavailable_reason(backend: str, device: torch.device, op: str | None = None) -> str | None:
    """None when `backend` can run `op` on `device`, else a sentence saying why not."""
    if op is not None and backend in _REQUIRES.get(op, {}):
        return _REQUIRES[op][backend](device)
    if backend == "reference":
        return None
    if backend == "triton":
        why = _triton_unavailable()
        if why is not None:
            return why
        if device.type == "cuda" or interpreting():
            return None
        return f"Triton kernels need a CUDA device, or TRITON_INTERPRET=1 on {device.type}"
    if backend in ("cuda", "cutlass"):
        if device.type != "cuda":
            return f"the CUDA extension runs on CUDA tensors, not {device.type}"
        ext = cuda_extension()
        if ext is None:
            return "the CUDA extension solrl_engine._C is not built (docs/kernels-and-numerics.md: build it)"
        if op is not None and not hasattr(ext, op):
            return f"the CUDA extension has no {op} kernel"
        return None
    raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS}")


def requested_backend() -> str | None:
    """The backend named by SOLRL_BACKEND, validated."""
    v = os.environ.get(ENV_VAR, "").strip().lower()
    if not v or v == "auto":
        return None
    if v not in BACKENDS:
        raise ValueError(f"{ENV_VAR}={v!r} is not a backend; use one of {BACKENDS} (or unset it).")
    return v


@functools.cache
def _warn_once(msg: str) -> None:
    log.warning(msg)


_OPS: dict[str, dict[str, Callable]] = {}
_REQUIRES: dict[str, dict[str, Callable[[torch.device], str | None]]] = {}
_FITS: dict[str, dict[str, Callable[..., str | None]]] = {}


def register(
    op: str,
    impls: dict[str, Callable],
    requires: dict[str, Callable[[torch.device], str | None]] | None = None,
    fits: dict[str, Callable[..., str | None]] | None = None,
) -> None:
    """Declare the implementations of `op`, keyed by backend; "reference" is required.

    `requires` overrides the backend's generic availability check for this op (a function of the
    device returning None or the reason it cannot run), e.g. a `cuda` GEMM that needs sm_100.
    `fits` says whether a backend can run one call's shapes and options (keyword arguments of
    `choose`), e.g. a GEMM that needs K % 32 == 0: None, or the reason it cannot.
    """
    if "reference" not in impls or not set(impls) <= set(BACKENDS):
        raise ValueError(f"{op}: implementations must include 'reference' and use backends {BACKENDS}.")
    _OPS[op] = impls
    _REQUIRES[op] = dict(requires or {})
    _FITS[op] = dict(fits or {})


def ops() -> dict[str, tuple[str, ...]]:
    """Every registered op and the backends that implement it."""
    return {op: tuple(impls) for op, impls in _OPS.items()}


def _order(op: str, device: torch.device) -> tuple[str | None, list[str]]:
    """(SOLRL_BACKEND's request, the backends to try in order): the request, then cuda and triton where
    the device is GPU-like, then the reference. `choose` and `select` both walk it, so they agree."""
    if op not in _OPS:
        raise KeyError(f"unknown op {op!r}; registered: {sorted(_OPS)}")
    want = requested_backend()
    order = ([want] if want else []) + [b for b in ("cuda", "triton") if gpu_like(device)] + ["reference"]
    return want, list(dict.fromkeys(order))


def _first(
    op: str, device: torch.device, shape: dict[str, Any] | None
) -> tuple[str, str | None, list[tuple[str, str]]]:
    """(the first backend in `_order` that can run `op` on `device`, the request, each (backend, reason) tried
    before it). With `shape` (choose), each implementation's `fits` is asked too; without (select), only
    whether it runs on the device."""
    want, order = _order(op, device)
    passed = []
    for b in order:
        if b not in _OPS[op]:
            reason = "not implemented for this op"
        else:
            reason = unavailable_reason(b, device, op)
            fit = _FITS[op].get(b)
            if reason is None and shape is not None and fit is not None:
                reason = fit(device, **shape)
        if reason is None:
            return b, want, passed
        passed.append((b, reason))
    raise RuntimeError(f"no implementation of {op} can run on {device}")  # unreachable: reference always can


def choose(op: str, device: torch.device | str, **shape: Any) -> tuple[str, str]:
    """(backend, why) for one layer's calls of `op` on `device` with these shapes and options:
    chosen once (quantize_model records it in QuantReport) instead of at every call.

    Each implementation answers whether it can run here and these shapes (`register`'s requires
    and fits); the first that can, in the order SOLRL_BACKEND's request, cuda, triton, reference,
    wins, and `why` names the choice and each implementation passed over with its reason.
    """
    b, want, tried = _first(op, torch.device(device), shape)
    passed = [f"{p}: {reason}" for p, reason in tried if p == want or p in _OPS[op]]
    how = "requested by SOLRL_BACKEND" if b == want else "default"
    return b, f"{b} ({how})" + (f"; passed over: {'; '.join(passed)}" if passed else "")


def run(op: str, backend: str, *args: object, **kw: object) -> Any:
    """Run `op` through `backend` (a choice `choose` made)."""
    return _OPS[op][backend](*args, **kw)


def select(op: str, device: torch.device | str) -> str:
    """The backend that runs `op` for a tensor on `device`: `choose`'s order without the shapes. When
    SOLRL_BACKEND's request cannot run here, the call takes the next and says so once in the log."""
    device = torch.device(device)
    chosen, want, tried = _first(op, device, None)
    if want is not None and chosen != want:
        reason = "it has no implementation of this op" if want not in _OPS[op] else tried[0][1]
        _warn_once(f"{ENV_VAR}={want} cannot run {op} on {device.type}: {reason}; using {chosen}.")
    return chosen


def call(op: str, device: torch.device, *args: object, **kw: object) -> Any:
    """Run `op` through the backend `select` picks for `device`."""
    return _OPS[op][select(op, device)](*args, **kw)


# --- what actually ran ------------------------------------------------------------------------------

REFERENCE = "reference"


@dataclass(frozen=True)
class Run:
    """One layer's last GEMM call: the implementation that computed it (`impl`, e.g. "cuda: cuBLASLt
    FP8 row-wise _scaled_mm" or "reference"), the input's dtype and shape, the output dtype, the device."""

    impl: str
    dtype: str
    shape: tuple[int, ...]
    out_dtype: str
    device: str

    @property
    def fast(self) -> bool:
        return not self.impl.startswith(REFERENCE)


_RUNS: dict[str, Run] = {}
_CURRENT = threading.local()


def ran(impl: str) -> None:
    """Called by an implementation at the point it computes: the label of what ran (the last wins, so a
    wrapper that hands the call to the reference is recorded as the reference)."""
    _CURRENT.impl = impl


def ran_with(detail: str) -> None:
    """Add `detail` to the label the implementation that just ran gave (`ran`): a caller's word on how it called it."""
    _CURRENT.impl = f"{getattr(_CURRENT, 'impl', None) or 'unrecorded'}{detail}"


def record_run(tag: str, fn: Callable[[], torch.Tensor], x: torch.Tensor, hint: str = "") -> torch.Tensor:
    """Run `fn` (one layer's GEMM, tagged `tag`) and record the implementation it reports through
    `ran`. On a GPU (or a simulated one), landing on the reference warns once per layer, naming the
    layer, the dtype, the shape and `hint` (the fix)."""
    _CURRENT.impl = None
    y = fn()
    impl = getattr(_CURRENT, "impl", None) or "unrecorded"
    _RUNS[tag] = Run(impl, str(x.dtype).removeprefix("torch."), tuple(x.shape), str(y.dtype).removeprefix("torch."),
                     x.device.type)  # fmt: skip
    if not _RUNS[tag].fast and gpu_like(x.device):
        where = x.device.type + ("" if x.device.type == "cuda" else " (simulated GPU)")
        _warn_once(f"{tag}: the slow reference ran on a {x.dtype} input of shape {tuple(x.shape)} on {where}; "
                   f"{hint or 'see the log'}")  # fmt: skip
    return y


def runs() -> dict[str, Run]:
    """Layer tag -> its last recorded GEMM call (`record_run`)."""
    return dict(_RUNS)


def forget_run(tag: str) -> None:
    """Forget what `tag` last ran (a layer before a measured call; a copy's attention when it is set up again)."""
    _RUNS.pop(tag, None)


def backend_report(device: torch.device | str | None = None) -> dict[str, str]:
    """Backend -> "available" or the reason it is not, for `solrl version`."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return {b: unavailable_reason(b, dev) or "available" for b in BACKENDS}
