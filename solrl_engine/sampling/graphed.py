"""A compiled, CUDA-graph-captured sampler: the whole denoising loop for one batch shape is one graph.

Why: at rollout batch sizes a DiT step is dozens of kernel launches per layer; replaying a captured
graph removes the CPU launch overhead of every step at once, and `torch.compile` fuses the
elementwise work in between. Weights are read from the modules' own storage, so `requantize_`
(which writes in place) and in-place LoRA/EMA updates are seen by the next replay with no re-capture
and no recompile. What a graph cannot see is a Python-level switch (a different PEFT adapter made
active, a different transformer object): those are part of the cache key (`tag`, the transformer's
id), so each gets its own graph once.

On a CPU there are no graphs: with `cpu_compile=True` the denoiser is torch.compile'd through
inductor (C++; one compile per batch shape and Python-level state, the first call of each timed as
`stats.compile_s`), else, and with `enabled=False`, it is the eager `sample`, unchanged.

How it compiles (solrl_engine.sampling.compile): a rollout copy's repeated blocks in place, once per
block class (regional); a module that trains (the policy, sampling with an adapter active), its blocks
compiled only while the sampler calls it; inductor's default mode unless `mode` asks for autotuning;
every compiled graph's GEMMs counted in `stats.census` (quantized layers take their traced form there:
the quantize fused into its producer).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from solrl_engine.models.base import Conditioning, FlowModel
from solrl_engine.sampling.capture import Violation, rehearse_capture
from solrl_engine.sampling.compile import (
    Census,
    RegionalWhileCalled,
    census_backend,
    check_mode,
    compile_regions,
    repeated_blocks,
    trainable,
)
from solrl_engine.sampling.sampler import SOLVERS, _solve, sample, sample_sde, schedule_pair, seeded_noise
from solrl_engine.sampling.sde import SDE_SOLVERS, Coupling, sde_window

log = logging.getLogger("solrl_engine.sampling")


@dataclass
class _Graph:
    """A captured loop and every tensor it reads or writes: all must outlive the graph."""

    graph: torch.cuda.CUDAGraph
    x: torch.Tensor
    cond: Conditioning
    out: torch.Tensor
    sig: torch.Tensor
    uncond: Conditioning | None


@dataclass
class GraphStats:
    """What capture and compilation cost and how often they were avoided (the bench reports these).
    compile_s (the first, compiling forward of each shape: GPU warm-up, CPU forward) and capture_s
    (GPU: the graph capture alone) are one-off costs: `overhead_s` is their sum, which the trainer keeps
    out of its phase times. `census`: what the compiled graphs compute their GEMMs with."""

    captures: int = 0
    capture_s: list[float] = field(default_factory=list)
    replays: int = 0
    compiles: int = 0
    compile_s: list[float] = field(default_factory=list)
    census: Census = field(default_factory=Census)

    @property
    def overhead_s(self) -> float:
        return sum(self.capture_s) + sum(self.compile_s)


class _Compiled:
    """A torch.compile'd denoiser that is truthy: in torch 2.13 the compiled module's `__len__`
    forwards to the module's (which has none) and raises, so `transformer or model.transformer` in the
    models' `velocity` fails on it. Attributes are read from the compiled module."""

    def __init__(self, compiled: nn.Module) -> None:
        self._compiled = compiled

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._compiled(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._compiled, name)


def _capture_autocast(dev: str, amp: tuple[bool, torch.dtype]) -> contextlib.AbstractContextManager:
    """The caller's autocast (`amp`: enabled, dtype) for a captured region, with its weight-cast cache off (cached
    casts would go stale between replays); none where `dev` has no autocast (the meta device of a rehearsal)."""
    if amp[0] and torch.amp.is_autocast_available(dev):
        return torch.autocast(dev, dtype=amp[1], cache_enabled=False)
    return contextlib.nullcontext()


class GraphedSampler:
    """`sample` with each (batch, steps, solver, ...) shape captured once and replayed after.

    compile: torch.compile the denoiser first (`mode`, default inductor's without autotuning; no
    inductor CUDA graphs in any mode: we capture ourselves). Batches are chunked to `batch_size`; a
    short last chunk gets a graph of its own size (no padded rows computed), captured once.
    regional: compile a rollout copy's repeated blocks (`blocks`: the ModelSpec's `repeated_blocks`)
    in place rather than the whole module.
    """

    def __init__(
        self, model: FlowModel, enabled: bool = True, compile: bool = True, warmup: int = 1, cpu_compile: bool = False,
        mode: str | None = None, regional: bool = True, blocks: Sequence[str] = (),
    ) -> None:  # fmt: skip
        """`cpu_compile`: on a CPU, torch.compile (inductor) instead of sampling eagerly. Off by
        default: a compile costs tens of seconds on a few cores (the `compile` family and
        compiled_sampler turn it on); it also needs a C++ compiler, without one it stays eager."""
        if warmup < 1:
            raise ValueError("warmup must be >= 1: Triton autotuning and compilation must run before capture")
        self.model = model
        self.enabled = enabled
        self.compile = compile
        self.warmup = warmup
        self.mode = check_mode(mode)
        self.regional = regional
        self.blocks = tuple(blocks)
        self.cpu_compile = cpu_compile and enabled and compile
        if self.cpu_compile:
            from solrl_engine.hw import cpu_compile_available

            ok, why = cpu_compile_available()
            if not ok:
                log.warning("compiled sampler on CPU: %s; sampling eagerly", why)
                self.cpu_compile = False
        self.stats = GraphStats()
        self._graphs: dict[tuple, _Graph] = {}
        self._compiled: dict[int, Any] = {}
        self._warm: set[str] = set()  # CPU: the (module, shapes, state) keys compiled so far
        self._eager: set[int] = set()  # CPU: modules whose compilation failed, sampled eagerly
        self._pool: Any = None
        # the policy's own transformer sampled eagerly: set where its weights move between storages (full
        # fine-tuning swaps whole weight sets), which a captured graph, reading fixed addresses, would not see
        self.eager_policy = False

    def _samples_eagerly(self, transformer: nn.Module | None) -> bool:
        """Whether `transformer` (None: the policy) samples eagerly: the policy with `eager_policy` (full fine-tuning
        or sharded), and a module whose forwards gather its weights from the other ranks (`gathers`: a sharded
        explore copy, rl/sharding.ShardedCopy), which neither a captured graph nor a compiled region can hold."""
        policy = transformer is None or transformer is self.model.transformer
        return (self.eager_policy and policy) or bool(getattr(transformer, "gathers", False))

    def _module(self, transformer: nn.Module | None) -> Any:
        """The compiled form of `transformer` (default the model's). Regional (the default): a rollout
        copy's repeated blocks compiled in place; a module that trains, its blocks compiled only while
        the sampler calls it. Else (or with no repeated blocks found) a compiled wrapper of the whole."""
        mod = transformer if transformer is not None else self.model.transformer
        if not self.compile:
            return mod
        if id(mod) not in self._compiled:
            backend = census_backend(self.stats.census, self.mode)
            blocks = repeated_blocks(mod, self.blocks) if self.regional else []
            names = ", ".join(sorted({type(b).__name__ for b in blocks}))
            if blocks and trainable(mod):
                log.info("regional compile: %d repeated blocks (%s) of a training module, compiled while sampling",
                         len(blocks), names)  # fmt: skip
                self._compiled[id(mod)] = RegionalWhileCalled(mod, blocks, backend)
            elif blocks:
                compile_regions(mod, backend, self.blocks)
                log.info("regional compile: %d repeated blocks (%s) compiled in place", len(blocks), names)
                self._compiled[id(mod)] = mod
            else:
                self._compiled[id(mod)] = _Compiled(torch.compile(mod, backend=backend, dynamic=False))
        return self._compiled[id(mod)]

    @torch.no_grad()
    def sample(
        self,
        cond: Conditioning,
        seeds: Sequence[int],
        steps: int,
        shift: float | None = None,
        solver: str = "euler",
        batch_size: int | None = None,
        dtype: torch.dtype = torch.float32,
        transformer: nn.Module | None = None,
        tag: str = "",
        guidance_scale: float = 1.0,
        uncond: Conditioning | None = None,
        noise_level: float = 0.7,
        window: tuple[int, int] | None = None,
        trace: list[torch.Tensor] | None = None,
        couple: Coupling | None = None,
    ) -> torch.Tensor:
        """Same contract as `solrl_engine.sampling.sample`; `tag` names state the graph cannot see
        (e.g. the active LoRA adapter). Flow-GRPO's SDE (solver flow_sde, or any solver given a `window` of SDE
        steps or a `couple`) runs step by step, each forward through `predict`'s path (one graph per forward on a
        GPU: its per-step noise is drawn on the host); `trace` receives each batch's window states (sampling.sde);
        `couple`: the noise of that finer SDE's Brownian path (sampling.sde.coupled_noise)."""
        device = cond.hidden.device
        if solver in SDE_SOLVERS or window is not None or couple is not None:
            return self._sample_sde(cond, seeds, steps, shift, batch_size, dtype, transformer, tag, guidance_scale,
                                    uncond, noise_level, window, trace, couple)  # fmt: skip
        if self._samples_eagerly(transformer):
            return sample(self.model, cond, seeds, steps, shift, solver, guidance_scale, uncond, batch_size, dtype,
                          transformer)  # fmt: skip
        if self.cpu_compile and device.type == "cpu":
            return self._sample_cpu(cond, seeds, steps, shift, solver, batch_size, dtype, transformer, tag,
                                    guidance_scale, uncond)  # fmt: skip
        if not self.enabled or device.type != "cuda":
            return sample(self.model, cond, seeds, steps, shift, solver, guidance_scale, uncond, batch_size, dtype,
                          transformer)  # fmt: skip
        if solver not in SOLVERS:
            raise ValueError(f"unknown solver {solver!r}; choose one of {SOLVERS}")
        if len(cond) != len(seeds):
            raise ValueError(f"{len(cond)} conditionings for {len(seeds)} seeds")
        if guidance_scale != 1.0 and uncond is None:
            raise ValueError("classifier-free guidance needs `uncond` (the encoded empty prompt)")
        if guidance_scale == 1.0:
            uncond = None
        amp = (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))
        bs = batch_size or len(seeds)
        outs = []
        for i in range(0, len(seeds), bs):
            chunk, c = list(seeds[i : i + bs]), cond[i : i + bs]
            n = len(chunk)  # a short last chunk is captured at its own size: padding would compute waste rows
            x = seeded_noise(chunk, tuple(self.model.latent_shape), device, dtype)
            u_sig = None if uncond is None else [(tuple(t.shape), t.dtype) for t in uncond.tensors()]
            key = (n, steps, shift, solver, dtype, [(tuple(t.shape), t.dtype) for t in c.tensors()],
                   id(transformer), tag, guidance_scale, u_sig, amp)  # fmt: skip
            key = repr(key)
            g = self._graphs.get(key) or self._capture(key, x, c, steps, shift, solver, transformer, guidance_scale,
                                                       uncond, amp)  # fmt: skip
            g.x.copy_(x)
            for dst, src in zip(g.cond.tensors(), c.tensors(), strict=True):
                dst.copy_(src)
            if g.uncond is not None:
                for dst, src in zip(g.uncond.tensors(), uncond.tensors(), strict=True):
                    dst.copy_(src)
            g.graph.replay()
            self.stats.replays += 1
            outs.append(g.out.clone())
        return torch.cat(outs)

    def _sample_sde(self, cond: Conditioning, seeds: Sequence[int], steps: int, shift: float | None,
                    batch_size: int | None, dtype: torch.dtype, transformer: nn.Module | None, tag: str,
                    guidance_scale: float, uncond: Conditioning | None, noise_level: float,
                    window: tuple[int, int] | None, trace: list[torch.Tensor] | None,
                    couple: Coupling | None = None) -> torch.Tensor:  # fmt: skip
        """Flow-GRPO's SDE over batches of `batch_size` seeds, every velocity through `predict`."""
        if len(cond) != len(seeds):
            raise ValueError(f"{len(cond)} conditionings for {len(seeds)} seeds")
        if guidance_scale != 1.0 and uncond is None:
            raise ValueError("classifier-free guidance needs `uncond` (the encoded empty prompt)")
        device = cond.hidden.device
        _, host = schedule_pair(self.model, steps, shift, device)
        window = window or sde_window(steps, 0, None, None)
        fine = (schedule_pair(self.model, couple.steps, shift, device)[1], couple.window) if couple else None
        bs = batch_size or len(seeds)

        def velocity(x: torch.Tensor, t: torch.Tensor, c: Conditioning) -> torch.Tensor:
            return self.predict(x, t, c, batch_size=bs, transformer=transformer, tag=tag)

        outs = []
        for i in range(0, len(seeds), bs):
            chunk = list(seeds[i : i + bs])
            x = seeded_noise(chunk, tuple(self.model.latent_shape), device, dtype)
            outs.append(sample_sde(velocity, x, cond[i : i + bs], chunk, host, window, noise_level, guidance_scale,
                                   uncond, trace, fine))  # fmt: skip
        return torch.cat(outs)

    @torch.no_grad()
    def predict(
        self,
        x: torch.Tensor,
        t: torch.Tensor,
        cond: Conditioning,
        batch_size: int | None = None,
        transformer: nn.Module | None = None,
        tag: str = "",
    ) -> torch.Tensor:
        """The denoiser's velocity at rows (x[i], t[i], cond[i]), `batch_size` rows a call, through the path its
        rollouts take on a GPU: the compiled module in one CUDA graph per (rows, shapes, module, `tag`, autocast).
        Eagerly on a CPU, even with `cpu_compile`: inductor would compile each new shape (these rows are not the
        rollouts' batches), tens of seconds on a few cores, more than a short run's predictions save. For
        predictions fixed for a whole update
        (the "old" and reference policies' velocities), which need no gradient and can run at the rollouts' batch
        instead of the training micro-batch."""
        if len(x) != len(t) or len(x) != len(cond):
            raise ValueError(f"predict: {len(x)} rows of x, {len(t)} flow times, {len(cond)} conditionings")
        device, bs = x.device, batch_size or len(x)
        mod_eager = transformer if transformer is not None else self.model.transformer
        if not self.enabled or self._samples_eagerly(transformer) or device.type != "cuda":
            return torch.cat([self.model.velocity(x[i : i + bs], t[i : i + bs], cond[i : i + bs], transformer)
                              for i in range(0, len(x), bs)])  # fmt: skip
        mod = self._module(transformer)
        amp = (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))
        outs = []
        for i in range(0, len(x), bs):
            xc, tc, c = x[i : i + bs], t[i : i + bs].to(device=device, dtype=torch.float32), cond[i : i + bs]
            key = repr(("predict", len(xc), xc.dtype, [(tuple(a.shape), a.dtype) for a in c.tensors()],
                        id(mod_eager), tag, amp))  # fmt: skip
            g = self._graphs.get(key) or self._capture_predict(key, xc, tc, c, mod, amp)
            g.x.copy_(xc)
            g.sig.copy_(tc)
            for dst, src in zip(g.cond.tensors(), c.tensors(), strict=True):
                dst.copy_(src)
            g.graph.replay()
            self.stats.replays += 1
            outs.append(g.out.clone())  # graphs share a pool: another replay may reuse this memory
        return torch.cat(outs)

    def _capture_predict(self, key: str, x: torch.Tensor, t: torch.Tensor, cond: Conditioning, mod: Any,
                         amp: tuple[bool, torch.dtype]) -> _Graph:  # fmt: skip
        """One velocity call over static copies of its inputs, captured (`_record`)."""
        run, sx, st, sc = self._predict_region(x, t, cond, mod, amp)
        graph, out = self._record(run)
        g = _Graph(graph, sx, sc, out, st, None)
        self._graphs[key] = g
        log.info("prediction graph (batch %d): compile + warm-up %.1f s, capture %.2f s", len(x),
                 self.stats.compile_s[-1], self.stats.capture_s[-1])  # fmt: skip
        return g

    def _predict_region(self, x: torch.Tensor, t: torch.Tensor, cond: Conditioning, mod: Any,
                        amp: tuple[bool, torch.dtype]
                        ) -> tuple[Callable[[], torch.Tensor], torch.Tensor, torch.Tensor, Conditioning]:  # fmt: skip
        """What a prediction's capture records: one velocity call over static copies of its inputs (returned with
        them: they must outlive the graph); `rehearse_predict` checks it without a GPU."""
        sx, st, sc = x.clone(), t.clone(), cond.map(torch.clone)

        def run() -> torch.Tensor:
            with _capture_autocast(x.device.type, amp):
                return self.model.velocity(sx, st, sc, transformer=mod)

        return run, sx, st, sc

    def rehearse_predict(self, x: torch.Tensor, t: torch.Tensor, cond: Conditioning,
                         transformer: nn.Module | None = None) -> list[Violation]:  # fmt: skip
        """A prediction's capture rehearsed on x's device (the meta device: shapes only) under CaptureGuard: every
        op a CUDA graph could not hold, with its line of code; empty when the capture is safe."""
        amp = (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))
        run = self._predict_region(x, t, cond, self._module(transformer), amp)[0]
        return rehearse_capture(run, x.device)

    def _sample_cpu(
        self,
        cond: Conditioning,
        seeds: Sequence[int],
        steps: int,
        shift: float | None,
        solver: str,
        batch_size: int | None,
        dtype: torch.dtype,
        transformer: nn.Module | None,
        tag: str,
        guidance_scale: float,
        uncond: Conditioning | None,
    ) -> torch.Tensor:
        """`sample` through the inductor-compiled denoiser (default mode: max-autotune's GEMM search
        costs minutes on a CPU). Chunks keep their own size (padding would cost real compute here),
        so each batch size compiles once; the first call of each (module, shapes, adapter tag,
        autocast) is a warm-up forward timed into `stats.compile_s`. A module that fails to compile
        is sampled eagerly from then on, with a warning."""
        mod_eager = transformer or self.model.transformer
        if id(mod_eager) in self._eager:
            return sample(self.model, cond, seeds, steps, shift, solver, guidance_scale, uncond, batch_size, dtype,
                          transformer)  # fmt: skip
        mod = self._module(transformer)
        bs = batch_size or len(seeds)
        amp = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))
        for i in range(0, len(seeds), bs):
            c = cond[i : i + bs]
            key = repr((id(mod_eager), len(c), dtype, [(tuple(t.shape), t.dtype) for t in c.tensors()], tag, amp,
                        guidance_scale != 1.0))  # fmt: skip
            if key in self._warm:
                continue
            x = seeded_noise(list(seeds[i : i + bs]), tuple(self.model.latent_shape), cond.hidden.device, dtype)
            t0 = time.perf_counter()
            try:
                t = torch.ones((), device=x.device)
                self.model.velocity(x, t, c, transformer=mod)
                if guidance_scale != 1.0 and uncond is not None:  # the guidance branch's expanded rows
                    self.model.velocity(x, t, uncond.against(c), transformer=mod)
            except Exception as e:  # noqa: BLE001 - any inductor/dynamo failure: sample this module eagerly
                log.warning("torch.compile failed on the CPU (%s: %s); sampling this denoiser eagerly",
                            type(e).__name__, str(e).splitlines()[0] if str(e) else "")  # fmt: skip
                self._eager.add(id(mod_eager))
                return sample(self.model, cond, seeds, steps, shift, solver, guidance_scale, uncond, batch_size,
                              dtype, transformer)  # fmt: skip
            self._warm.add(key)
            self.stats.compiles += 1
            self.stats.compile_s.append(time.perf_counter() - t0)
            log.info("compiled the sampler's denoiser on CPU (batch %d) in %.1f s; %s", len(c),
                     self.stats.compile_s[-1], self.stats.census.summary())  # fmt: skip
        return sample(self.model, cond, seeds, steps, shift, solver, guidance_scale, uncond, batch_size, dtype, mod)

    def _region(
        self,
        x: torch.Tensor,
        cond: Conditioning,
        steps: int,
        shift: float | None,
        solver: str,
        transformer: nn.Module | None,
        guidance_scale: float,
        uncond: Conditioning | None,
        amp: tuple[bool, torch.dtype],
    ) -> tuple[Callable[[], torch.Tensor], torch.Tensor, Conditioning, torch.Tensor, Conditioning | None]:
        """What a capture records: the loop over static copies of its inputs (returned with them: they must
        outlive the graph). Everything the loop reads is made on x's device here, before capture; `rehearse`
        checks that without a GPU."""
        mod = self._module(transformer)
        sig, host = schedule_pair(self.model, steps, shift, x.device)
        sx, sc = x.clone(), cond.map(torch.clone)
        su = None if uncond is None else uncond.map(torch.clone)

        def run() -> torch.Tensor:
            with _capture_autocast(x.device.type, amp):
                return _solve(self.model, sx, sc, sig, host, solver, guidance_scale, su, mod)

        return run, sx, sc, sig, su

    def rehearse(
        self,
        cond: Conditioning,
        seeds: Sequence[int],
        steps: int,
        shift: float | None = None,
        solver: str = "euler",
        dtype: torch.dtype = torch.float32,
        transformer: nn.Module | None = None,
        guidance_scale: float = 1.0,
        uncond: Conditioning | None = None,
    ) -> list[Violation]:
        """The capture of one batch rehearsed on cond's device (the meta device: shapes only) under
        CaptureGuard: every op of the captured loop that a CUDA graph could not hold (host syncs, host
        tensors, host-to-device copies), with its line of code; empty when the capture is safe."""
        x = seeded_noise(list(seeds), tuple(self.model.latent_shape), cond.hidden.device, dtype)
        amp = (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))
        run = self._region(x, cond, steps, shift, solver, transformer, guidance_scale,
                           None if guidance_scale == 1.0 else uncond, amp)[0]  # fmt: skip
        return rehearse_capture(run, x.device)

    def _capture(
        self,
        key: str,
        x: torch.Tensor,
        cond: Conditioning,
        steps: int,
        shift: float | None,
        solver: str,
        transformer: nn.Module | None,
        guidance_scale: float,
        uncond: Conditioning | None,
        amp: tuple[bool, torch.dtype],
    ) -> _Graph:
        run, sx, sc, sig, su = self._region(x, cond, steps, shift, solver, transformer, guidance_scale, uncond, amp)
        graph, out = self._record(run)
        g = _Graph(graph, sx, sc, out, sig, su)
        self._graphs[key] = g
        log.info("sampling graph (batch %d, %d steps): compile + warm-up %.1f s, capture %.2f s", len(x), steps,
                 self.stats.compile_s[-1], self.stats.capture_s[-1])  # fmt: skip
        if len(self.stats.census.graphs) and self.stats.captures == 1:
            log.info("compiled denoiser: %s", self.stats.census.summary())
        return g

    def _record(self, run: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Warm `run` up on a side stream (compile, autotune, cuBLAS workspaces), then capture it into one CUDA
        graph in the sampler's pool; both timed into `stats`. The graph and its output tensor."""
        t0 = time.perf_counter()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: compile, autotune and cuBLAS workspaces outside capture
            for _ in range(self.warmup):
                run()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        t1 = time.perf_counter()  # compile (first shape of a module) + warm-up forwards, apart from capture
        self.stats.compiles += 1
        self.stats.compile_s.append(t1 - t0)
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self._pool):
            out = run()
        torch.cuda.synchronize()
        self.stats.captures += 1
        self.stats.capture_s.append(time.perf_counter() - t1)
        return graph, out
