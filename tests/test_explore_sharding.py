"""explore_sharding=shard (rl/sharding.ShardedCopy): the explore copy's blocks split over the ranks, gathered whole for
each forward and for each refresh, on two gloo ranks with a tiny two-expert WanPipeline (Wan2.2-A14B's layout, the
model this is for) saved and loaded as a user's weights are, its copy in NVFP4 (codes, block scales, the swizzled
scales and a scalar global scale that stays whole). The split copy's velocities equal the whole copy's exactly,
before and after a refresh that merges a changed LoRA; each rank holds about half of the blocks' bytes. The trainer's
runs with it (tests/test_distributed.py, *-explore-sharded) match one process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from tiny_pipelines import MAX_SEQUENCE_LENGTH, SIZES, WAN_FRAMES, build_wan

SIDE = SIZES["wan"]
OPTS = dict(resolution=SIDE, width=SIDE, frames=WAN_FRAMES, max_sequence_length=MAX_SEQUENCE_LENGTH["wan"])


def _rank(rank: int, path: str, init: str) -> None:
    import torch.distributed as td

    from solrl_engine.explore.copy import ExploreCopy
    from solrl_engine.models import load_model, model_spec
    from solrl_engine.rl.adapters import OLD, LoraAdapters
    from solrl_engine.rl.distributed import Dist
    from solrl_engine.rl.sharding import ShardedCopy

    td.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        m = load_model("wan", path, "cpu", torch.float32, **OPTS)
        # as the trainer builds them: the copies from the base, then the LoRA, then the copies follow it
        whole = ExploreCopy(m.transformer, "nvfp4", borrow=True)
        split = ExploreCopy(m.transformer, "nvfp4", borrow=True)
        adapters = LoraAdapters(m.transformer, 4, 4, ("to_q", "to_k", "to_v", "to_out.0"))
        whole.attach(adapters)
        split.attach(adapters)
        sharded = ShardedCopy(split.transformer, model_spec("wan").repeated_blocks, Dist(rank, 2))
        split.whole_blocks = sharded.whole
        assert len(sharded.blocks) == 4  # both experts' two blocks
        assert 0.45 * sharded.whole_bytes < sharded.local_bytes < 0.6 * sharded.whole_bytes
        assert split.transformer.gathers  # the sampler's cue to sample it eagerly

        cond = m.encode_prompts(["a red apple", "a blue car"])
        x = torch.randn(2, *m.latent_shape, generator=torch.Generator().manual_seed(1))

        def both(t: float) -> tuple[torch.Tensor, torch.Tensor]:
            tt = torch.full((2,), t)  # above and below the boundary: each expert runs
            with torch.no_grad():
                return (m.velocity(x, tt, cond, transformer=whole.transformer),
                        m.velocity(x, tt, cond, transformer=split.transformer))  # fmt: skip

        for t in (0.95, 0.3):
            a, b = both(t)
            assert torch.equal(a, b), (t, (a - b).abs().max())
        blk = next(iter(sharded.blocks.values()))
        # dropped again after its forward (what has fewer rows than ranks, Wan's (1, 6, dim) table, stays whole)
        held = [t for t in [*blk.parameters(), *blk.buffers()] if t.dim() > 0 and t.shape[0] != 1]
        assert held and all(t.shape[0] == 0 for t in held)
        before = both(0.3)[0]
        with torch.no_grad():  # a changed "old" adapter, the same on both ranks, merged into both copies
            g = torch.Generator().manual_seed(2)
            for p in adapters.params(OLD):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        whole.refresh(adapters)
        asked: list[list[str]] = []
        split.whole_blocks = lambda names: (asked.append(list(names)), sharded.whole(names))[1]
        split.refresh(adapters)
        # one block's weights at a time (each of the 4: a two-expert name "transformer_2.blocks.1..." is its block's)
        assert len(asked) == 4 and all(len({".".join(n.split(".")[:3]) for n in names}) == 1 for names in asked)
        for t in (0.95, 0.3):
            a, b = both(t)
            assert torch.equal(a, b), (t, (a - b).abs().max())
        assert (both(0.3)[0] - before).abs().max() > 1e-3  # the refresh changed what the copies compute
    finally:
        td.destroy_process_group()


class Blk(torch.nn.Module):
    """A block whose first tensor has an odd number of bytes per rank (6 uint8 over 2 ranks: 3 each), as NVFP4's
    1-D swizzled scales have on 6 or 24 ranks, followed by FP32 and BF16 ones that must each start aligned."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.register_buffer("codes", torch.randint(0, 255, (6,), dtype=torch.uint8, generator=g))
        self.lin = torch.nn.Linear(4, 5)
        self.register_buffer("scale", torch.rand(3, 2, generator=g).to(torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.codes.float().mean() + self.scale.float().sum()


def _rank_odd(rank: int, init: str) -> None:
    import torch.distributed as td

    from solrl_engine.rl.distributed import Dist
    from solrl_engine.rl.sharding import ShardedCopy

    td.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        import copy

        torch.manual_seed(0)
        net = torch.nn.Sequential(Blk(1), Blk(2))
        ref = copy.deepcopy(net)  # the whole copy
        x = torch.randn(3, 4)

        def run(m: torch.nn.Module) -> torch.Tensor:
            with torch.no_grad():
                return m[1](m[0](x)[:, :4])

        split = ShardedCopy(net, ("Blk",), Dist(rank, 2))
        assert net[0].codes.shape == (0,) and net[0].lin.weight.shape == (0, 4)  # split: each rank's rows only
        assert torch.equal(run(net), run(ref))
        with split.whole(["1.lin.weight"]):  # a refresh's write into one block is kept, each rank its rows
            net[1].lin.weight.data.mul_(2.0)
        ref[1].lin.weight.data.mul_(2.0)
        assert torch.equal(run(net), run(ref))
    finally:
        td.destroy_process_group()


def test_a_split_block_with_odd_byte_shares_gathers_every_tensor_aligned(tmp_path: Path):
    mp.spawn(_rank_odd, args=(f"file://{tmp_path / 'store'}",), nprocs=2, join=True)


def test_a_split_copy_computes_what_the_whole_copy_does_before_and_after_a_refresh(tmp_path: Path):
    path = build_wan(tmp_path / "wan", two_experts=True)
    mp.spawn(_rank, args=(str(path), f"file://{tmp_path / 'store'}"), nprocs=2, join=True)


SIZED = {"train_batch_size": 16, "gradient_checkpointing": False}  # (set: the plans compared do not re-size)


def test_the_plan_splits_the_copy_and_auto_splits_it_only_where_a_whole_copy_does_not_fit():
    """The plan's copy is 1/gpus of the whole one with its largest two blocks gathered while exploring and the whole
    copy held at start before it is split; auto resolves to "shard" only for a sharded run on several GPUs whose
    plan does not fit with the copy whole, and records it in the resolved config."""
    from solrl_engine.rl import memplan
    from solrl_engine.rl.config import RLConfig
    from solrl_engine.rl.runtime import Target, resolve

    cfg = dict(name="t", model="tiny", policy_dtype="bfloat16", sharding="fsdp", explore_precision="nvfp4", **SIZED)
    whole = memplan.memory_plan(RLConfig(**cfg, explore_sharding="none"), gpus=4)
    split = memplan.memory_plan(RLConfig(**cfg, explore_sharding="shard"), gpus=4)
    w, s = {r.part: r for r in whole.rows}, {r.part: r for r in split.rows}
    assert s["explore copy"].gib == pytest.approx(w["explore copy"].gib / 4)
    assert "split over 4" in s["explore copy"].note
    assert 0 < s["explore copy, gathered blocks"].gib < w["explore copy"].gib
    assert s["explore copy, gathered blocks"].when == "rollout"
    assert s["explore copy, before it is split"].gib == pytest.approx(w["explore copy"].gib * 3 / 4)
    assert s["explore copy, before it is split"].when == "start"
    assert memplan.memory_plan(RLConfig(**cfg, explore_sharding="auto"), gpus=4).rows == whole.rows  # auto: whole
    assert split.peak_gib < whole.peak_gib
    tight = (whole.peak_gib + split.peak_gib) / 2 / memplan.HEADROOM  # a whole copy does not fit, a split one does
    run = resolve(RLConfig(**cfg), Target.gpu(tight, world=4))
    assert run.cfg.explore_sharding == "shard" and run.memory.fits
    assert any("explore copy: split over the 4 GPUs" in line for line in run.lines())  # what `solrl plan` prints
    assert resolve(RLConfig(**cfg), Target.gpu(80.0, world=4)).cfg.explore_sharding == "none"  # fits whole
    assert resolve(RLConfig(**{**cfg, "sharding": "none"}), Target.gpu(tight, world=4)).cfg.explore_sharding == "none"
    assert resolve(RLConfig(**cfg), Target.gpu(tight, world=1)).cfg.explore_sharding == "none"  # one GPU


def test_bad_explore_sharding_is_refused_naming_the_fix():
    from solrl_engine.rl.config import ConfigError, RLConfig

    with pytest.raises(ConfigError, match="explore_sharding.*choose one of"):
        RLConfig(model="tiny", sharding="fsdp", explore_sharding="fsdp").validate()
    with pytest.raises(ConfigError, match="explore_sharding.*set sharding=fsdp"):
        RLConfig(model="tiny", explore_sharding="shard").validate()
    with pytest.raises(ConfigError, match="explore_sharding.*sol_rl or naive_quant"):
        RLConfig(model="tiny", sharding="fsdp", family="naive_scaling", explore_sharding="shard").validate()
    with pytest.raises(ConfigError, match="explore_sharding.*explore_precision=nvfp4"):
        RLConfig(model="tiny", sharding="fsdp", explore_precision="te_nvfp4", explore_sharding="shard").validate()
    RLConfig(model="tiny", sharding="fsdp", explore_sharding="shard").validate()
