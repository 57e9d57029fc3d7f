"""A memory plan before renting GPUs: what each part of a run holds on one GPU, for a config, computed without
loading a weight.

    solrl plan configs/flux1.py:flux_sol_rl_pickscore --gpu-memory 80
    solrl plan configs/tiny.py:tiny_sol_rl_shapes --set train_mode=full --gpus 8 --gpu-memory 80 --json plan.json

The transformer is built on fake tensors (torch's FakeTensorMode: shapes and dtypes, no storage) from the config's
model: a local pipeline directory's own transformer config, the Hugging Face cache's copy of a hub id, else the
family's published config. Its parameters, the LoRA, the explore copy under the family's layer rule (planned as
`quantize_model` would, nothing quantized) and the optimizer state are counted; the activations of one update
micro-batch (train_batch_size, with and without gradient checkpointing) and of one rollout forward
(rollout_batch_size; twice that under classifier-free guidance) are measured by running the forward (and the
backward) on fake tensors under torch's MemTracker. Text encoders and the VAE are the family's published sizes
(models/*.py). The trainer checks the plan at start on a GPU and refuses one that cannot fit, before any weight
loads (`memory_check=false` starts anyway).

Every rank of a torchrun job holds all of this unless `sharding=fsdp` (or `hsdp`: over a node's GPUs, not all of
them): then a LoRA run's frozen base weights are 1/gpus per rank, plus the two largest repeated blocks gathered at
a time, and no merged policy copy is kept; the explore copy and the adapters stay whole on every rank. Full fine-
tuning sharded divides every trained tensor (weights, old, EMA, the stash, AdamW's moments, gradients) and the
reference by the GPUs, and gathers its blocks in FP32. A sharded start-up is staged: each rank loads the base on
the CPU, builds the explore copy on its GPU a layer at a time, and FSDP2 moves the base to the GPU a block at a
time as it shards it (upcast to FP32 just before, for full fine-tuning), so the start-up peak is one block whole.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import weakref
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from solrl_engine.models.experts import boundary_ratio
from solrl_engine.rl.config import FAMILY_TABLE, ConfigError, RLConfig
from solrl_engine.rl.sizing import AUTO, HEADROOM, NothingFits, UpdateSizes, defaults, recompute_count, size_update

if TYPE_CHECKING:
    from solrl_engine.explore.plan import ExploreSpec

log = logging.getLogger("solrl_engine.rl")
GIB = 2**30
# "refresh": the copies following the updated policy; "start": what building the run holds only while it starts
PHASES = ("update", "rollout", "encode", "refresh", "start")


@dataclass
class PlanRow:
    part: str
    gib: float
    when: str  # "always": held through the run; "update", "rollout", "encode", "refresh", "start": only then
    note: str = ""


@dataclass
class MemoryPlan:
    """Per-GPU memory of a run, by part, and whether it fits `gpu_gib`."""

    config: str
    model: str
    train_mode: str
    gpus: int
    gpu_gib: float
    transformer_params_b: float
    transformer_source: str
    rows: list[PlanRow] = field(default_factory=list)
    train_batch_size: int = 1
    rollout_batch_size: int = 1
    # the update's activations both ways, whichever the config uses ("gradient_checkpointing", "without")
    update_activations_gib: dict[str, float] = field(default_factory=dict)
    lora_peak_gib: float | None = None  # a full fine-tuning plan's peak as LoRA instead
    sharding: str = "none"  # the config's: fsdp / hsdp shard a LoRA run's base weights (full: every weight)
    sharded_peak_gib: float | None = None  # an unsharded plan's peak with sharding=fsdp on these GPUs
    blocks: int = 0  # the transformer's repeated blocks (what gradient_checkpointing recomputes, one by one)
    update_sizes: str = ""  # how train_batch_size and gradient_checkpointing were resolved (rl/sizing.py)
    # host memory per rank: the base while a staged start-up holds it on the CPU (rl/runtime.staged), and the text
    # encoders offloaded there between encodes; every rank of a node holds its own
    host_gib: float = 0.0
    host_note: str = ""  # what host_gib holds

    def total(self, when: str) -> float:
        return sum(r.gib for r in self.rows if r.when == "always") + sum(r.gib for r in self.rows if r.when == when)

    @property
    def peak_gib(self) -> float:
        """The resident parts plus the largest phase (update, rollout or prompt encoding)."""
        return max(self.total(w) for w in PHASES)

    @property
    def peak_phase(self) -> str:
        return max(PHASES, key=self.total)

    @property
    def fits(self) -> bool:
        return self.peak_gib <= HEADROOM * self.gpu_gib

    def advice(self) -> list[str]:
        """What to change, largest saving first, when the plan does not fit."""
        if self.fits:
            return []
        by = {r.part: r for r in self.rows}
        out: list[tuple[float, str]] = []
        phase = self.peak_phase
        act = by.get("update activations")
        ckpt = self.update_activations_gib.get("gradient_checkpointing")
        if phase == "update" and act is not None and "checkpointing" not in act.note and ckpt is not None:
            out.append((act.gib - ckpt, f"--set gradient_checkpointing=true (update activations {act.gib:.2f} -> "
                                        f"{ckpt:.2f} GiB)"))  # fmt: skip
        if phase == "update" and act is not None and self.train_batch_size > 1:
            out.append((act.gib / 2, f"halve train_batch_size (update activations about {act.gib / 2:.2f} GiB less)"))
        roll = by.get("rollout activations")
        if phase == "rollout" and roll is not None and self.rollout_batch_size > 1:
            out.append((roll.gib / 2, f"halve rollout_batch_size (about {roll.gib / 2:.2f} GiB less)"))
        merged = by.get("merged policy copy")
        if merged is not None:
            out.append((merged.gib, f"--set merge_lora=false (no merged policy copy: {merged.gib:.2f} GiB less; "
                                    "full-precision rollouts then run PEFT's unmerged LoRA)"))  # fmt: skip
        enc = by.get("text encoders")
        if enc is not None and enc.when == "always":
            out.append((enc.gib, f"--set offload_text_encoders=true ({enc.gib:.1f} GiB off the GPU between encodes)"))
        if self.train_mode == "full" and self.lora_peak_gib is not None:
            tip = f"--set train_mode=lora (peak {self.peak_gib:.2f} -> {self.lora_peak_gib:.2f} GiB)"
            out.append((self.peak_gib - self.lora_peak_gib, tip))
        if self.sharded_peak_gib is not None and self.sharded_peak_gib < self.peak_gib:
            what = "the base weights" if self.train_mode == "lora" else "every weight and its optimizer state"
            tip = (f"--set sharding=fsdp under torchrun ({what} over the {self.gpus} GPUs: peak "
                   f"{self.peak_gib:.2f} -> {self.sharded_peak_gib:.2f} GiB)")  # fmt: skip
            out.append((self.peak_gib - self.sharded_peak_gib, tip))
        out.sort(key=lambda x: -x[0])
        tips = [t for _, t in out]
        more = ("more GPUs shard only the base weights (sharding=fsdp)" if self.train_mode == "lora"
                else "more GPUs shard every weight and its optimizer state (sharding=fsdp)")
        tips.append(f"a GPU with more memory (this plan peaks at {self.peak_gib:.2f} GiB against {HEADROOM:.0%} of "
                    f"{self.gpu_gib:g} GiB); {more}")  # fmt: skip
        return tips

    def render(self) -> str:
        shard = f", sharding={self.sharding}" if self.sharding != "none" else ""
        head = (f"memory plan for {self.config} ({self.model}, train_mode={self.train_mode}{shard}): transformer "
                f"{self.transformer_params_b:.2f}B parameters ({self.transformer_source}); per GPU, "
                f"{self.gpus} GPU{'s' if self.gpus > 1 else ''} of {self.gpu_gib:g} GiB")  # fmt: skip
        width = max([28] + [len(r.part) for r in self.rows])
        lines = [head] + ([f"  update sizes: {self.update_sizes}"] if self.update_sizes else [])
        lines.append(f"  {'part':{width}s} {'GiB':>8s}  when      note")
        for r in self.rows:
            lines.append(f"  {r.part:{width}s} {r.gib:8.2f}  {r.when:8s}  {r.note}")
        for w in PHASES:
            lines.append(f"  {'peak during ' + w:{width}s} {self.total(w):8.2f}")
        verdict = "fits" if self.fits else "DOES NOT FIT"
        lines.append(f"  {verdict}: peak {self.peak_gib:.2f} GiB ({self.peak_phase}) against {HEADROOM:.0%} of "
                     f"{self.gpu_gib:g} GiB = {HEADROOM * self.gpu_gib:.1f} GiB")  # fmt: skip
        lines.append("  not counted: the reward model's weights, the VAE decode's activations (decode_batch_size), "
                     "CUDA's context")
        if self.host_gib:
            lines.append(f"  host memory per rank: {self.host_gib:.1f} GiB ({self.host_note}); every rank of a node "
                         "holds its own")
        lines += [f"  - {t}" for t in self.advice()]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(peak_gib=self.peak_gib, peak_phase=self.peak_phase, fits=self.fits, advice=self.advice(),
                 headroom=HEADROOM)  # fmt: skip
        return d


# --- the transformer, on fake tensors --------------------------------------------------------------------------


def _local_transformer_config(path: str | None) -> tuple[dict[str, Any] | None, str]:
    """A pipeline's transformer/config.json: from a local directory, or the Hugging Face cache's copy of a hub id."""
    if not path:
        return None, ""
    p = Path(path)
    if (p / "transformer" / "config.json").is_file():
        return json.loads((p / "transformer" / "config.json").read_text()), f"{p / 'transformer'}"
    with contextlib.suppress(Exception):
        from huggingface_hub import try_to_load_from_cache

        hit = try_to_load_from_cache(str(path), "transformer/config.json")
        if isinstance(hit, str):
            return json.loads(Path(hit).read_text()), f"{path} (Hugging Face cache)"
    return None, ""


def _import_outside(transformer_class: str) -> None:
    """Import diffusers' (lazily imported) modules of `transformer_class` before the fake mode is entered: a module
    first imported under FakeTensorMode keeps fake tensors in its globals, which corrupts the heap at exit."""
    import diffusers

    getattr(diffusers, transformer_class)
    import diffusers.models.attention_dispatch  # noqa: F401  (the attention backends a forward reaches)


def _fake_model(cfg: RLConfig, dtype: torch.dtype, fake: Any) -> tuple[Any, str]:
    """The config's model with its transformer on fake tensors (`fake`, a FakeTensorMode; pipelines get their
    stand-in text encoder and VAE, and a real scheduler: its set-up reads values, which fake tensors lack)."""
    from solrl_engine.models import load_model, model_spec
    from solrl_engine.models.pipeline import build_transformer

    spec = model_spec(cfg.model)
    if cfg.model == "tiny":
        from solrl_engine.models.tiny.model import WEIGHTS_DIR, TinyConfig, TinyT2I

        path = Path(cfg.model_path) if cfg.model_path else WEIGHTS_DIR
        conf = json.loads((path / "config.json").read_text()) if (path / "config.json").is_file() else {}
        tc = TinyConfig(**{k: v for k, v in conf.items() if k in TinyConfig.__dataclass_fields__})
        _import_outside("SD3Transformer2DModel")
        default = torch.get_default_dtype()
        torch.set_default_dtype(dtype)  # built in the policy dtype (a fake module cannot be converted after)
        try:
            with fake:
                model = TinyT2I(tc)
        finally:
            torch.set_default_dtype(default)
        return model, f"the bundled model's config ({path})"
    config, source = _local_transformer_config(cfg.model_path)
    adapter = spec.adapter_object()
    if config is None:
        by_hub = getattr(adapter, "HUB_CONFIGS", {})
        if cfg.model_path in by_hub:
            config, source = by_hub[cfg.model_path], f"the published config of {cfg.model_path}"
        else:
            config = adapter.FULL_CONFIG
            source = f"the published config of {spec.default_path}"
            if cfg.model_path and cfg.model_path != spec.default_path:
                source += f" ({cfg.model_path} is not on this machine: its own size may differ)"
    _import_outside(adapter.TRANSFORMER_CLASS)
    import diffusers

    # a config written by another diffusers version may hold keys this class does not take (from_config drops them)
    takes = inspect.signature(getattr(diffusers, adapter.TRANSFORMER_CLASS).__init__).parameters
    arch = {k: v for k, v in config.items() if k in takes and k != "self"}
    with fake:
        net = build_transformer(adapter, dtype, arch)
    options: dict[str, Any] = {"resolution": cfg.resolution, "transformer": net, "arch": arch, "place": False}
    ratio = boundary_ratio(cfg.model_path, getattr(adapter, "HUB_EXPERTS", {}))
    if ratio is not None:  # two experts (Wan2.2-A14B): both on the GPU, both quantized, LoRA on those trained
        with fake:
            options.update(boundary_ratio=ratio, transformer_2=build_transformer(adapter, dtype, arch),
                           lora_experts=cfg.lora_experts)  # fmt: skip
        source += f", two experts (boundary_ratio {ratio})"
    if spec.video:
        options.update(frames=cfg.frames, width=cfg.width)
    return load_model(cfg.model, "random", "cpu", dtype, **options), source


class _PeakBytes(TorchDispatchMode):
    """The peak of bytes held by tensors that ops create while it is active: new storages, counted once, freed
    when the storage dies (views and in-place results of an op's inputs are not new). On fake tensors: shapes
    only, no memory, one counter update per op (torch's MemTracker, which agrees with it within 3% on the bundled
    model and on FLUX.1, also attributes every byte to a module, which costs minutes on a 57-block model)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._seen: set[int] = set()

    def _free(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        leaves = torch.utils._pytree.tree_leaves
        # a view or in-place result of an input (a weight's transpose, say) holds no new memory
        inputs = {id(a.untyped_storage()) for a in leaves((args, kwargs)) if isinstance(a, torch.Tensor)}
        for t in leaves(out):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                key = id(st)
                if key not in self._seen and key not in inputs:
                    self._seen.add(key)
                    self.live += st.nbytes()
                    weakref.finalize(st, self._free, key, st.nbytes())
        self.peak = max(self.peak, self.live)
        return out


def _measure(model: Any, batch: int, train: bool, checkpointing: bool, cond: Any) -> float:
    """Peak bytes of activations and temporaries of one forward (and backward when `train`) at `batch`, on fake
    tensors. Every weight takes gradients (the saved activations of full fine-tuning, a bound for LoRA's), each
    dropped as soon as it is computed: the plan counts the trained weights' gradients itself."""
    net = model.transformer
    if checkpointing and hasattr(net, "enable_gradient_checkpointing"):
        net.enable_gradient_checkpointing()
    elif hasattr(net, "disable_gradient_checkpointing"):
        net.disable_gradient_checkpointing()
    net.requires_grad_(train)
    net.train(train)
    hooks = [p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None)) for p in net.parameters()
             if train]  # fmt: skip
    x = torch.randn(batch, *model.latent_shape, dtype=next(net.parameters()).dtype)
    t = torch.full((batch,), 0.5)
    tracker = _PeakBytes()
    grad = contextlib.nullcontext() if train else torch.no_grad()
    try:
        with tracker, grad:
            v = model.velocity(x, t, cond)
            if train:
                v.float().square().mean().backward()
            del v
    finally:
        for h in hooks:
            h.remove()
    return float(tracker.peak)


class _Copy(NamedTuple):
    """One explore copy the run may end with: its spec, its stored bytes, the weights it leaves unquantized, the
    layers it quantizes, and the LoRA layers' weights among the unquantized (a LoRA copy holds its own merged ones
    of those and shares the rest with the frozen base)."""

    spec: ExploreSpec
    stored: float
    unquantized: int
    layers: int
    lora_kept: int

    def bytes(self, own_all: bool, elem: int) -> float:
        """Its memory: stored, plus every unquantized weight it owns (`own_all`: full fine-tuning or sharded), else
        only its merged LoRA layers, at `elem` bytes each."""
        return self.stored + (self.unquantized if own_all else self.lora_kept) * elem


def memory_plan(cfg: RLConfig, gpus: int = 1, gpu_gib: float = 80.0, explore: Sequence[ExploreSpec] | None = None,
                sizes: UpdateSizes | None = None) -> MemoryPlan:  # fmt: skip
    """The per-GPU memory plan of `cfg` on `gpus` GPUs of `gpu_gib` GiB each (see the module docstring). `explore`:
    the specs its explore pass can resolve to at start (explore.plan.foresee; the largest copy is planned), by
    default those of a GPU whose architecture is not known; `sizes`: the update's sizes as resolved (else auto
    ones are resolved here)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from solrl_engine.explore.plan import foresee
    from solrl_engine.models import model_spec
    from solrl_engine.nn import plan_quantization
    from solrl_engine.quant.recipe import get_recipe
    cfg = cfg.validate()
    if gpus % cfg.context_parallel:
        raise ConfigError(f"config {cfg.name!r}: context_parallel = {cfg.context_parallel} does not divide {gpus} GPUs "
                          "into groups: plan a multiple of it (--gpus)")  # fmt: skip
    resolved = sizes
    if resolved is None and AUTO in (cfg.train_batch_size, cfg.gradient_checkpointing):  # sized for these GPUs
        try:
            resolved = resolve_update_sizes(cfg, gpus, gpu_gib)
        except NothingFits as e:  # the plan of the smallest update shows what to change
            resolved = e.smallest()
    cfg = resolved.apply(cfg) if resolved is not None else cfg
    spec = model_spec(cfg.model)
    dtype = torch.float32 if cfg.policy_dtype == "float32" else torch.bfloat16  # auto: BF16 on every GPU
    b = torch.tensor([], dtype=dtype).element_size()
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    model, source = _fake_model(cfg, dtype, fake)
    train_bs, roll_bs = cfg.train_batch_size, cfg.rollout_batch_size  # (guidance runs its two passes in turn)
    # the prompts' (stand-in) conditioning is real, made first: an encoder may read values (a mask's length)
    with torch.no_grad():  # (a text encoder's graph is not the update's)
        conds = {bs: model.encode_prompts(["a"] * bs) for bs in {train_bs, roll_bs}}
    settings = cfg.explore_settings()
    quantized = [] if not FAMILY_TABLE[cfg.family].quantized_explore else [
        e for e in (foresee(settings, spec, None) if explore is None else explore) if e.quantized]  # fmt: skip
    with fake:
        net = model.transformer
        params = sum(p.numel() for p in net.parameters())
        targets = spec.lora_targets if cfg.lora_targets is None else cfg.lora_targets
        # each copy the explore pass may end with, planned as `quantize_model` would; the largest is counted
        reports = [(e, plan_quantization(net, get_recipe(e.storage).with_(**e.rule))) for e in quantized]
        # explore_precision=auto's timing probe at start: one linear per distinct quantized shape at the policy's
        # dtype and its candidates' copies, fed the rollouts' rows (explore.choice.probe_explore_timings)
        probe = 0.0
        if any(e.timed_at_start for e, _ in reports):
            tokens = getattr(model, "tokens_per_sample", None) or 4096
            rows = min(32768, roll_bs * tokens)
            shapes = {(d.in_features, d.out_features) for _, r in reports for d in r.layers if d.quantized}
            probe = sum(k * n * (b + 2) + rows * (k + n) * b for k, n in shapes)  # weight, 8-bit copies, in/out
        lora = lora_all = 0
        target_sizes: dict[str, int] = {}  # the LoRA layers' weights, by name
        for n, m in net.named_modules():
            on = getattr(net, "trained", None)  # a two-expert model: the experts lora_experts names
            if any(n.endswith(t) for t in targets) and hasattr(m, "in_features") and (on is None or
                                                                                      n.split(".")[0] in on):
                lora += cfg.lora_rank * (m.in_features + m.out_features)
                lora_all += m.in_features * m.out_features
                target_sizes[n] = m.in_features * m.out_features
        copies = [_Copy(e, r.weight_bytes()[1], params - sum(d.in_features * d.out_features for d in r.layers
                                                             if d.quantized),
                        len(r.quantized), sum(target_sizes.get(d.name, 0) for d in r.layers if not d.quantized))
                  for e, r in reports]  # fmt: skip
        from solrl_engine.sampling.compile import repeated_blocks

        sizes_b = [sum(p.numel() for p in blk.parameters()) for blk in repeated_blocks(net, spec.repeated_blocks)]
        sizes = sorted(sizes_b, reverse=True)
        gathered = sum(sizes[:2])  # a sharded policy's blocks gathered at a time: this one and the next (prefetch)
        act_plain = _measure(model, train_bs, train=True, checkpointing=False, cond=conds[train_bs])
        act_ckpt = _measure(model, train_bs, train=True, checkpointing=True, cond=conds[train_bs])
        act_roll = _measure(model, roll_bs, train=False, checkpointing=False, cond=conds[roll_bs])
    # context_parallel=N: each rank holds 1/N of every sample's tokens through the blocks (an estimate: the
    # embeddings before the split, the output gathered after it and Ulysses' all-to-all buffers are not counted)
    cp = cfg.context_parallel
    act_plain, act_ckpt, act_roll = act_plain / cp, act_ckpt / cp, act_roll / cp
    over = f", its tokens over {cp} ranks (context_parallel)" if cp > 1 else ""

    def copy_of(full: bool, sharded: bool) -> tuple[ExploreSpec, float, int, str] | None:
        """The largest explore copy the run may end with: (its spec, its bytes, layers quantized, how)."""
        if not copies:
            return None
        # LoRA: the copy shares the frozen base's tensors (sharded: it keeps its own, whole, built before sharding)
        own = full or sharded
        c = max(copies, key=lambda c: c.bytes(own, b))
        names = ", ".join(x.spec.precision for x in copies)
        how = c.spec.precision if len(copies) == 1 else f"auto: planned as {c.spec.precision}, the largest of {names}"
        how += f", stored as {c.spec.storage}" if c.spec.storage != c.spec.precision else ""
        return c.spec, c.bytes(own, b), c.layers, how

    # the ranks each sharded tensor is split over: all of them (fsdp), or a group (hsdp: shard_group_size, else a
    # node's GPUs, taken as up to 8)
    shards = (cfg.shard_group_size or min(gpus, 8)) if cfg.sharding == "hsdp" else gpus

    def rows_for(mode: str, sharded: bool) -> list[PlanRow]:
        full = mode == "full"
        trained = params if full else lora
        split = shards if full and sharded else 1  # sharded full fine-tuning: every trained tensor over the GPUs
        per = f", this GPU's 1/{split}" if split > 1 else ""
        what = f"{trained / 1e6:.1f}M {'weights' if full else 'LoRA parameters'} in FP32{per}"
        if sharded:
            base = PlanRow("transformer (base)", params * b / shards / GIB, "always",
                           f"the reference policy: the base as loaded, FSDP2-sharded over {shards} GPUs" if full
                           else f"frozen, FSDP2-sharded over {shards} GPUs; LoRA on top, whole")  # fmt: skip
        else:
            base = PlanRow("transformer (base)", params * b / GIB, "always",
                           "the reference policy: the base as loaded" if full else "frozen; LoRA on top")
        rows = [base,
                PlanRow("trained weights", 4 * trained / split / GIB, "always", what),
                PlanRow("old + EMA policies", 8 * trained / split / GIB, "always",
                        f"FP32 copies of the trained weights{per}"),
                PlanRow("AdamW state", 8 * trained / split / GIB, "always", f"two FP32 moments{per}"),
                PlanRow("gradients", 4 * trained / split / GIB, "update", f"FP32{per}"),
                PlanRow("optimizer step", 4 * trained / split / GIB, "update",
                        "AdamW's (foreach) temporaries")]  # fmt: skip
        if full and sharded:
            rows.append(PlanRow("trained weights' stash", 4 * trained / split / GIB, "always",
                                "the trained shard, kept while the old, reference or EMA set computes"))  # fmt: skip
        if full and b < 4:
            why = ("autocast's, of the gathered blocks" if sharded
                   else "autocast keeps one per FP32 trained weight through the update's forward")
            rows.append(PlanRow("BF16 casts of the weights", 2 * (gathered if sharded else params) / GIB, "update",
                                why))  # fmt: skip
        if gpus > 1 and split == 1:
            rows.append(PlanRow("gradient all-reduce", 4 * trained / GIB, "update", "one flat FP32 buffer"))
        elif gpus > 1:
            rows.append(PlanRow("gradient reduce-scatter", 4 * (sizes[0] if sizes else 0) / GIB, "update",
                                "the largest block's FP32 gradients whole, before FSDP2 scatters them"))  # fmt: skip
        copy_gib, copy = 0.0, copy_of(full, sharded)
        if sharded and shards > 1:
            rows.append(PlanRow("gathered blocks", gathered * (4 if full else b) / GIB, "always",
                                "the largest two repeated blocks whole (one computing, the next gathered)"))
        if copy is not None:
            copy_spec, copy_gib, n_q, how = copy
            if sharded and gpus > 1 and cfg.explore_sharding == "shard":  # its blocks over every rank (ShardedCopy)
                rows.append(PlanRow("explore copy", copy_gib / gpus / GIB, "always", f"{n_q} layers quantized ({how}); "
                                    f"split over {gpus} GPUs (explore_sharding=shard)"))  # fmt: skip
                rows.append(PlanRow("explore copy, gathered blocks", copy_gib * gathered / params / GIB, "rollout",
                                    "its largest two blocks whole while they compute (an estimate: the copy's "
                                    "share of them)"))  # fmt: skip
                rows.append(PlanRow("explore copy, before it is split", copy_gib * (1 - 1 / gpus) / GIB, "start",
                                    "built whole on each GPU, a layer at a time, then split"))  # fmt: skip
            else:
                rows.append(PlanRow("explore copy", copy_gib / GIB, "always", f"{n_q} layers quantized ({how})"))
        if cfg.merge_lora and not full and not sharded:
            rows.append(PlanRow("merged policy copy", lora_all * b / GIB, "always",
                                "the LoRA layers merged, for full-precision rollouts"))  # fmt: skip
        # (the copies are built on the base's own storage, ExploreCopy(borrow=True): no second whole copy at start,
        # but Transformer Engine's layers take a deep copy over)
        if copy is not None and copy_spec.built_from_whole_copy:
            rows.append(PlanRow("explore copy, being built", max(0.0, params * b - copy_gib) / GIB, "start",
                                "te_nvfp4: the whole transformer copied before TE's layers take it over"))  # fmt: skip
        if probe:
            rows.append(PlanRow("auto's timing probe", probe / GIB, "start",
                                "one layer per quantized shape, at the rollouts' token rows"))  # fmt: skip
        if copy is not None or (cfg.merge_lora and not full and not sharded):
            rows.append(PlanRow("refresh, one block's weights", (sizes[0] if sizes else params) * (4 if full else b)
                                / GIB, "refresh", "the copies refresh a block at a time: its merged (or gathered) "
                                "weights"))  # fmt: skip
        if sharded and shards > 1:  # a staged start-up (rl/runtime.staged): the base loads on the CPU
            rows.append(PlanRow("a block being sharded", (sizes[0] if sizes else params) * (4 if full else b) / GIB,
                                "start", f"each rank loads the base on the CPU ({params * b / GIB:.1f} GiB of host "
                                "memory), and FSDP2 moves it here a block at a time as it shards it"
                                + (", each upcast to FP32 just before" if full else "")))  # fmt: skip
        k = recompute_count(cfg.gradient_checkpointing, len(sizes_b))
        act = act_plain - (k / len(sizes_b) * (act_plain - act_ckpt) if sizes_b else 0.0)
        how = "" if not k else (", gradient checkpointing" if k == len(sizes_b) else f", {k} of {len(sizes_b)} "
                                                                                      "blocks recomputed")
        rows.append(PlanRow("update activations", act / GIB, "update", f"train_batch_size {train_bs}{how}{over}"))
        rows.append(PlanRow("rollout activations", act_roll / GIB, "rollout", f"rollout_batch_size {roll_bs}{over}"))
        text = sum(spec.text_encoder_params_b.values()) * 1e9 * b / GIB
        if text:
            where = ("on the GPU only while new prompts are encoded" if cfg.offload_text_encoders
                     else "kept on the GPU (offload_text_encoders=false)")  # fmt: skip
            rows.append(PlanRow("text encoders", text, "encode" if cfg.offload_text_encoders else "always",
                                f"{' + '.join(spec.text_encoder_params_b)}; {where}"))  # fmt: skip
        if spec.vae_params_b:
            rows.append(PlanRow("VAE", spec.vae_params_b * 1e9 * b / GIB, "always", "published size"))
        return rows

    def plan_for(mode: str, sharded: bool, **more: Any) -> MemoryPlan:
        text_host = sum(spec.text_encoder_params_b.values()) * 1e9 * b if cfg.offload_text_encoders else 0.0
        base_host = params * b if sharded and gpus > 1 else 0.0  # (a staged start-up: rl/runtime.staged)
        what = [w for w, n in (("the base, while the sharded start-up holds it on the CPU", base_host),
                               ("the text encoders, offloaded there between encodes", text_host)) if n]  # fmt: skip
        return MemoryPlan(cfg.name, cfg.model, mode, gpus, gpu_gib, params / 1e9, source, rows_for(mode, sharded),
                          sharding=cfg.sharding if sharded else "none", host_gib=(base_host + text_host) / GIB,
                          host_note="; ".join(what), **more)  # fmt: skip

    sharded = cfg.sharding != "none"  # (one GPU: nothing split, no merged copy)
    lora_peak = plan_for("lora", sharded).peak_gib if cfg.train_mode == "full" else None  # on the same sharding
    could_shard = not sharded and gpus > 1 and not FAMILY_TABLE[cfg.family].compiled
    shard_peak = plan_for(cfg.train_mode, True).peak_gib if could_shard else None
    return plan_for(cfg.train_mode, sharded, train_batch_size=train_bs, rollout_batch_size=roll_bs,
                    lora_peak_gib=lora_peak, sharded_peak_gib=shard_peak, blocks=len(sizes_b),
                    update_activations_gib={"gradient_checkpointing": act_ckpt / GIB, "without": act_plain / GIB},
                    update_sizes="" if resolved is None else resolved.reason)  # fmt: skip


def host_shortfall(plan: MemoryPlan, ranks_here: int, available_gib: float | None) -> str | None:
    """Why this node's host memory may not hold what its `ranks_here` ranks load at start (each its own base on the
    CPU, staged, and its offloaded text encoders: `plan.host_gib`), or None: the kernel's available memory is
    enough, or not known."""
    need = plan.host_gib * ranks_here
    if available_gib is None or not plan.host_gib or need <= available_gib:
        return None
    return (f"the {ranks_here} ranks on this node each load the base on the CPU at start (a sharded start-up) with "
            f"their offloaded text encoders: about {need:.0f} GiB of host memory, and {available_gib:.0f} GiB is "
            "available; start fewer ranks a node (torchrun --nproc_per_node), free host memory, or expect the "
            "kernel to swap or stop a rank")  # fmt: skip


def resolve_update_sizes(cfg: RLConfig, world: int, gpu_gib: float | None) -> UpdateSizes:
    """`cfg`'s train_batch_size and gradient_checkpointing on `world` GPUs of `gpu_gib` GiB (None: a CPU), auto
    sized from the plan of one sample (rl/sizing.py says how). A ConfigError, before any weight loads, where not
    even one sample with every block recomputed fits; a plan that cannot be made keeps the defaults, warned."""
    if AUTO not in (cfg.train_batch_size, cfg.gradient_checkpointing):
        return UpdateSizes(cfg.train_batch_size, cfg.gradient_checkpointing, "set in the config")
    if gpu_gib is None:
        return defaults(cfg, "no GPU memory to size against (a CPU): the defaults")
    try:  # one sample, no recompute: the plan measures one sample's activations both ways
        plan = memory_plan(UpdateSizes(1, False, "").apply(cfg), world, gpu_gib)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - advice, not a gate: a plan that cannot be made keeps the defaults
        log.warning("train_batch_size / gradient_checkpointing auto: no memory plan (%s: %s); using the defaults",
                    type(e).__name__, str(e)[:200])  # fmt: skip
        return defaults(cfg, "no memory plan could be made: the defaults")
    plain, ckpt = plan.update_activations_gib["without"], plan.update_activations_gib["gradient_checkpointing"]
    try:
        return size_update(cfg, world, gpu_gib, plan.total("update") - plain, plain, ckpt, plan.blocks, plan.advice())
    except ConfigError as e:
        if cfg.memory_check:
            raise
        log.warning("%s; memory_check=false: starting with the defaults", e)
        return defaults(cfg, "nothing fits, memory_check=false: the defaults")


def device_memory_gib(device: torch.device) -> float | None:
    """A CUDA device's memory in GiB; None elsewhere (a CPU run is not checked)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(device).total_memory / GIB
