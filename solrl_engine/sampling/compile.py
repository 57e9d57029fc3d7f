"""How rollouts compile a denoiser: the repeated block once (regional), no autotuning by default, an
optional persistent cache, and a census of what every compiled graph computes its GEMMs with.

Why regional: a DiT is one block class repeated 20-60 times. Compiling each block instance through
the same code lets dynamo trace it once (parameters are graph inputs) and reuse the graph for every
instance, so a full-size denoiser compiles in the time of one or two blocks, as diffusers'
`compile_repeated_blocks` does; embeddings and the final layer stay eager (a few percent of the FLOPs).

Why no max-autotune by default: its GEMM search costs minutes per shape on a fresh machine, and the
GEMMs that matter here are cuBLASLt calls (`torch._scaled_mm`, `torch._int_mm`, BF16 `mm`) it cannot
beat by much; `compile_mode="max-autotune-no-cudagraphs"` asks for it.

Why a census: a quantized layer under torch.compile runs inside a graph, where no per-call record can
be kept (`solrl_engine.nn.fast_path` records eager calls). The census is taken from the graph dynamo
hands to inductor, once per compile, so it says what every later call of that graph computes with: how
many GEMMs are traced scaled GEMMs (quantize fused), opaque quantized ops, or BF16/FP32 linears.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

log = logging.getLogger("solrl_engine.sampling")

# None: inductor's default (no autotuning); the other: its GEMM/kernel search, which costs minutes per shape
# on a fresh machine. Modes with inductor's own CUDA graphs are left out: the sampler captures its own.
COMPILE_MODES = (None, "max-autotune-no-cudagraphs")

# what a graph node computes, by call target (dynamo's graphs hold torch-level calls)
_KINDS: dict[Any, str] = {
    torch._scaled_mm: "scaled_mm (FP8/FP4, quantize traced)",
    torch._int_mm: "int_mm (INT8, quantize traced)",
    torch.nn.functional.linear: "linear (full precision)",
    torch._C._nn.linear: "linear (full precision)",
    torch.matmul: "matmul (full precision)",
    torch.mm: "matmul (full precision)",
    torch.bmm: "matmul (full precision)",
    torch.nn.functional.conv2d: "conv2d (full precision)",
}
# our GEMM-only custom ops: the quantize before them is traced (plain torch ops), the GEMM and its epilogue are one op
_TRACED_OPS = {"solrl.int8_gemm": "int8_gemm (INT8 Triton GEMM, quantize traced)"}
# a producer that emits its output's codes (nn.producers): not a GEMM, but where the GEMMs' quantize went
PRODUCER = "adaln_quantize (producer: norm, modulation and 8-bit codes in one op)"
GELU_PRODUCER = "gelu_quantize (producer: an FFN's GELU and 8-bit codes in one op)"
GLU_PRODUCER = "glu_quantize (producer: a gated FFN's gate and 8-bit codes in one op)"
RMS_PRODUCER = "rms_quantize (producer: an RMS norm, its modulation and 8-bit codes in one op)"
PRODUCER_KINDS = (PRODUCER, GELU_PRODUCER, GLU_PRODUCER, RMS_PRODUCER)
_OTHER_OPS = {"solrl.adaln_quantize": PRODUCER, "solrl.gelu_quantize": GELU_PRODUCER,
              "solrl.glu_quantize": GLU_PRODUCER, "solrl.rms_quantize": RMS_PRODUCER}
TRACED_KINDS = ("scaled_mm (FP8/FP4, quantize traced)", "int_mm (INT8, quantize traced)", *_TRACED_OPS.values())
OPAQUE = "opaque quantized op (quantize not fused)"


def _kind(target: Any) -> str | None:
    """A node target's GEMM kind; our custom ops (torch.ops.solrl.*) print as "solrl.<op>[.overload]"."""
    name = str(target)
    if name.startswith("solrl."):
        op = name.rsplit(".", 1)[0] if name.count(".") > 1 else name
        return _TRACED_OPS.get(op) or _OTHER_OPS.get(op, OPAQUE)
    return _KINDS.get(target)


# a traced 8-bit GEMM whose activation operand is a producer's codes (not a quantize traced in the graph)
FED = "of the traced GEMMs, fed by a producer's codes"
# what lies between a producer's op and the GEMM reading its codes: views, the codes' pick, the wrapper, padding
_PASS = {"getitem", "getattr", "reshape", "view", "flatten", "contiguous", "t", "transpose", "permute", "movedim",
         "unflatten", "squeeze", "unsqueeze", "pad", "Prequantized", "cat"}  # fmt: skip


def _name(target: Any) -> str:
    return target if isinstance(target, str) else getattr(target, "__name__", str(target))


def _fed(node: torch.fx.Node) -> bool:
    """Whether a GEMM node's activation operand (its first argument) is a producer's codes: followed back through
    views and picks only (a traced quantize computes it with arithmetic: amax, where, clamp)."""
    todo, seen = [node.args[0]], set()
    while todo:
        n = todo.pop()
        if isinstance(n, list | tuple):
            todo.extend(n[:1])
            continue
        if not isinstance(n, torch.fx.Node) or n in seen or n.op not in ("call_function", "call_method"):
            continue
        seen.add(n)
        if _kind(n.target) in PRODUCER_KINDS:
            return True
        if _name(n.target) in _PASS:
            todo.extend(a for a in n.args if isinstance(a, torch.fx.Node | list | tuple))
    return False


def gemm_census(gm: torch.fx.GraphModule) -> Counter[str]:
    """GEMM-like nodes of one dynamo graph by kind (see `_KINDS`): what the compiled code will run; and how many of
    the traced ones read a producer's codes (`FED`: the quantize made where its input is, not traced again)."""
    counts: Counter[str] = Counter()
    for node in gm.graph.nodes:
        if node.op == "call_function":
            kind = _kind(node.target)
            if kind is not None:
                counts[kind] += 1
                if kind in TRACED_KINDS and _fed(node):
                    counts[FED] += 1
    return counts


@dataclass
class Census:
    """What the graphs compiled so far compute their GEMMs with (one entry per compiled graph)."""

    graphs: list[Counter[str]] = field(default_factory=list)

    def total(self) -> Counter[str]:
        out: Counter[str] = Counter()
        for g in self.graphs:
            out.update(g)
        return out

    @property
    def traced(self) -> int:
        t = self.total()
        return sum(t[k] for k in TRACED_KINDS)

    @property
    def opaque(self) -> int:
        return self.total()[OPAQUE]

    def gemms(self) -> Counter[str]:
        """GEMM-like nodes by kind over every graph (the fed count, a subset of the traced ones, apart)."""
        out = self.total()
        out.pop(FED, None)
        return out

    def summary(self) -> str:
        """One line, e.g. "2 graphs: 9 scaled_mm (FP8/FP4, quantize traced), 3 linear (full precision)"."""
        if not self.graphs:
            return "nothing compiled yet"
        parts = ", ".join(f"{n} {k}" for k, n in self.gemms().most_common())
        fed = f"; {self.fed} {FED}" if self.fed else ""
        return f"{len(self.graphs)} compiled graph{'s' if len(self.graphs) != 1 else ''}: {parts or 'no GEMMs'}{fed}"

    @property
    def fed(self) -> int:
        return self.total()[FED]

    def to_dict(self) -> dict[str, Any]:
        return {"graphs": len(self.graphs), "gemms": dict(self.gemms()), "traced": self.traced, "opaque": self.opaque,
                "fed": self.fed}  # fmt: skip


def census_backend(census: Census, mode: str | None = None, inner: str = "inductor") -> Callable[..., Any]:
    """A torch.compile backend: inductor (with `mode`'s options) after counting the graph's GEMMs;
    `inner="eager"` runs the traced graph as is (dynamo's tracing without inductor: quick checks)."""
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx

    patches = list_mode_options(mode) if mode is not None else {}

    def backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        census.graphs.append(gemm_census(gm))
        if inner == "eager":
            return gm.forward
        return compile_fx(gm, list(example_inputs), config_patches=dict(patches))

    return backend


def check_mode(mode: str | None) -> str | None:
    """`mode` if torch.compile knows it, else a clear error naming the choices."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile_mode={mode!r}: use null (inductor's default, no autotuning) or "
                         "'max-autotune-no-cudagraphs' (autotuned kernels; minutes per shape). Modes with inductor's "
                         "own CUDA graphs are refused: the sampler captures the whole loop itself")  # fmt: skip
    return mode


def use_cache_dir(path: str | Path | None) -> Path | None:
    """Point inductor's on-disk caches (FX graphs, autograd graphs, Triton kernels) at `path`, so a second
    run, or a fresh machine given the same directory, loads compiled code instead of compiling it.
    Must run before the first compile of the process; None leaves torch's per-user temporary default."""
    if path is None:
        return None
    p = Path(path).expanduser().resolve()
    p.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(p)
    os.environ.setdefault("TRITON_CACHE_DIR", str(p / "triton"))
    from torch._inductor import config as inductor_config

    inductor_config.fx_graph_cache = True
    if hasattr(inductor_config, "autotune_local_cache"):
        inductor_config.autotune_local_cache = True
    log.info("inductor cache directory: %s", p)
    return p


def repeated_blocks(transformer: nn.Module, names: Sequence[str] = ()) -> list[nn.Module]:
    """The instances of the repeated block classes `names` (a ModelSpec's `repeated_blocks`, else the
    diffusers class's own `_repeated_blocks`), outermost only."""
    wanted = set(names) or set(getattr(transformer, "_repeated_blocks", None) or ())
    found: list[nn.Module] = []
    inside: set[int] = set()
    for m in transformer.modules():
        if id(m) in inside:
            continue
        if type(m).__name__ in wanted:
            found.append(m)
            inside.update(id(s) for s in m.modules())
    return found


def trainable(module: nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters())


# Every instance of a block class shares one code object, and so dynamo's per-code cache: one entry per
# block variant (SD3's last block differs), batch shape, autocast state and copy (the explore and the
# policy copies). Its default limit (8) is met by sol_rl's two batch sizes over two copies; past it,
# dynamo runs the blocks eagerly without a word, which the census would show as graphs never compiled.
RECOMPILE_LIMIT = 64


def raise_recompile_limit(limit: int = RECOMPILE_LIMIT) -> None:
    """Let each block's code hold `limit` compiled entries (never lowers a larger setting)."""
    cfg = torch._dynamo.config
    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    setattr(cfg, name, max(getattr(cfg, name), limit))
    if hasattr(cfg, "accumulated_recompile_limit"):
        cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, 4 * limit)


def compile_regions(transformer: nn.Module, backend: Callable[..., Any], names: Sequence[str] = ()) -> int:
    """Compile each repeated block of `transformer` in place (`nn.Module.compile`); returns how many.
    In place, so only for rollout copies: a module that trains keeps its eager blocks (the caller
    compiles it whole, as a wrapper, instead)."""
    blocks = repeated_blocks(transformer, names)
    if blocks:
        raise_recompile_limit()
    for b in blocks:
        if getattr(b, "_compiled_call_impl", None) is None:
            b.compile(backend=backend, dynamic=False)
    return len(blocks)


class CompiledBlocks:
    """A module's repeated blocks compiled (regional), the compiled forms switched in only inside `active()`, so
    the module stays eager everywhere else. One per use: the sampler's calls of a module that trains (no gradient)
    and the update's forward and backward of the policy (rl/update.py) each hold their own, and each compiles a
    block class once per batch shape and grad mode; the dynamo cache belongs to the block's code, so switching
    costs nothing and recompiles nothing."""

    def __init__(self, blocks: Sequence[nn.Module], backend: Callable[..., Any]) -> None:
        raise_recompile_limit()
        self._impls = [(b, torch.compile(b._call_impl, backend=backend, dynamic=False)) for b in blocks]

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        for b, impl in self._impls:
            b._compiled_call_impl = impl
        try:
            yield
        finally:
            for b, _ in self._impls:
                b._compiled_call_impl = None


class RegionalWhileCalled:
    """A module that trains (the policy sampling with an adapter active, e.g. for evaluation), its repeated
    blocks compiled for the duration of each call only (CompiledBlocks): the training step's forward and
    backward never run these forms."""

    def __init__(self, module: nn.Module, blocks: Sequence[nn.Module], backend: Callable[..., Any]) -> None:
        self.module = module
        self._blocks = CompiledBlocks(blocks, backend)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self._blocks.active():
            return self.module(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.module, name)


def uncompile_regions(transformer: nn.Module) -> None:
    """Undo `compile_regions`: every block runs eagerly again (a benchmark that times both forms)."""
    for m in transformer.modules():
        if getattr(m, "_compiled_call_impl", None) is not None:
            m._compiled_call_impl = None
