"""The memory plan (rl/memplan.py, `solrl plan`): its peak counter against known allocations and against torch's
own MemTracker, its parts against the model's real parameter counts, the trainer's refusal before any weight
loads, and the command's exit code and JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from solrl_engine.rl import memplan
from solrl_engine.rl.config import ConfigError, RLConfig

ROOT = Path(__file__).resolve().parents[1]
SPEC = str(ROOT / "configs/tiny.py:tiny_sol_rl_shapes")
MIB = 2**20
# the update sized as before auto: these plans test their parts, not the sizing (tests/test_sizing.py)
SIZED = {"train_batch_size": 16, "gradient_checkpointing": False}


def test_peak_counter_counts_new_storages_once_and_frees_them():
    with FakeTensorMode():
        x = torch.empty(1024, 1024)  # 4 MiB, made before: never counted
        tr = memplan._PeakBytes()
        with tr:
            y = x * 2  # +4
            v = y.view(-1).t() if y.dim() == 1 else y.t()  # a view: nothing new
            y.add_(1)  # in place: nothing new
            z = y + v  # +4, peak 8
            del y, v
            w = torch.nn.functional.linear(x, x)  # (uses x's transpose, a view of an input) +4, z still alive
            del z, w
        assert tr.peak == 8 * MIB and tr.live == 0


def test_peak_counter_agrees_with_torch_memtracker_on_the_bundled_model():
    """torch's MemTracker (activations + temporaries) is the reference; ours skips its per-module bookkeeping."""
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    fake = FakeTensorMode(allow_non_fake_inputs=True)
    model, _ = memplan._fake_model(RLConfig(name="t", model="tiny"), torch.bfloat16, fake)
    with torch.no_grad():
        cond = model.encode_prompts(["a"] * 8)
    with fake:
        ours = memplan._measure(model, 8, train=True, checkpointing=False, cond=cond)
        net = model.transformer
        net.requires_grad_(True)
        x = torch.randn(8, *model.latent_shape, dtype=torch.bfloat16)
        t = torch.full((8,), 0.5)
        mt = MemTracker()
        mt.track_external(net)
        with mt:
            model.velocity(x, t, cond).float().square().mean().backward()
        peak = next(iter(mt.get_tracker_snapshot("peak").values()))
        theirs = peak[_MemRefType.ACT] + peak[_MemRefType.TEMP]
    assert ours == pytest.approx(theirs, rel=0.03)


def test_plan_parts_follow_the_model_and_the_mode():
    from solrl_engine.models.tiny.model import load_tiny

    real = load_tiny().transformer
    params = sum(p.numel() for p in real.parameters())
    lora = memplan.memory_plan(RLConfig(name="t", model="tiny", policy_dtype="bfloat16", **SIZED))
    full = memplan.memory_plan(RLConfig(name="t", model="tiny", policy_dtype="bfloat16", train_mode="full", **SIZED))
    assert lora.transformer_params_b * 1e9 == params
    rows = {r.part: r for r in full.rows}
    assert rows["transformer (base)"].gib == pytest.approx(2 * params / 2**30)  # the BF16 reference
    assert rows["trained weights"].gib == pytest.approx(4 * params / 2**30)
    assert rows["old + EMA policies"].gib + rows["AdamW state"].gib == pytest.approx(16 * params / 2**30)
    lrows = {r.part: r for r in lora.rows}
    assert lrows["trained weights"].gib < rows["trained weights"].gib / 5
    assert full.peak_gib > lora.peak_gib
    # checkpointing cuts the update's activations, and the plan says by how much
    ck = memplan.memory_plan(RLConfig(name="t", model="tiny", train_batch_size=16, gradient_checkpointing=True))
    assert {r.part: r for r in ck.rows}["update activations"].gib < lrows["update activations"].gib
    assert lora.fits and lora.advice() == []


def test_a_plan_that_cannot_fit_says_what_to_change():
    plan = memplan.memory_plan(RLConfig(name="t", model="tiny", train_mode="full", train_batch_size=16,
                                        gradient_checkpointing=False), gpus=8, gpu_gib=0.02)  # fmt: skip
    assert not plan.fits
    tips = plan.advice()
    assert any("gradient_checkpointing=true" in t for t in tips)
    assert any("train_mode=lora" in t for t in tips)
    assert "more GPUs shard every weight and its optimizer state (sharding=fsdp)" in tips[-1]
    assert plan.sharded_peak_gib is not None and plan.sharded_peak_gib < plan.peak_gib
    assert any(t.startswith("--set sharding=fsdp under torchrun (every weight") for t in tips)
    text = plan.render()
    assert "DOES NOT FIT" in text and "8 GPUs of 0.02 GiB" in text
    # sized automatically, nothing fits either: the plan shows the smallest update and says so
    auto = memplan.memory_plan(RLConfig(name="t", model="tiny", train_mode="full"), gpus=8, gpu_gib=0.02)
    assert not auto.fits and auto.train_batch_size == 1
    assert "update sizes: nothing fits (a micro-batch of one sample does not fit the update" in auto.render()


def test_a_sharded_lora_plan_splits_the_base_weights_and_keeps_no_merged_copy():
    """sharding=fsdp (rl/sharding.py): the frozen base is 1/gpus per GPU plus the two largest blocks gathered;
    no merged policy copy; the explore copy keeps its own unquantized tensors. An unsharded LoRA plan that does
    not fit on several GPUs names sharding=fsdp with the peak it would have."""
    from solrl_engine.models.tiny.model import load_tiny

    params = sum(p.numel() for p in load_tiny().transformer.parameters())
    cfg = {"name": "t", "model": "tiny", "policy_dtype": "bfloat16", **SIZED}
    plain = memplan.memory_plan(RLConfig(**cfg), gpus=4)
    shard = memplan.memory_plan(RLConfig(**cfg, sharding="fsdp"), gpus=4)
    rows, prow = {r.part: r for r in shard.rows}, {r.part: r for r in plain.rows}
    assert rows["transformer (base)"].gib == pytest.approx(2 * params / 4 / 2**30)
    assert 0 < rows["gathered blocks"].gib < prow["transformer (base)"].gib
    assert "merged policy copy" in prow and "merged policy copy" not in rows
    assert rows["explore copy"].gib > prow["explore copy"].gib  # its unquantized tensors are its own
    assert shard.sharding == "fsdp" and "sharding=fsdp" in shard.render()
    # start-up, staged (rl/runtime.staged): each rank loads the base on the CPU and FSDP2 moves one block whole to
    # the GPU at a time as it shards it; the copies are built on the base's own storage (ExploreCopy(borrow=True)), so
    # no "being built" row; a refresh holds one block's merged weights at a time
    block = rows["a block being sharded"]
    assert block.when == "start" and "host memory" in block.note and "base before sharding" not in rows
    # one of the tiny model's two equal repeated blocks (a sharded forward gathers two at a time), far less than
    # the whole base, which each rank used to hold on its GPU before sharding it
    assert block.gib == pytest.approx(rows["gathered blocks"].gib / 2) and block.gib < 2 * params / 2 / 2**30
    assert not any("being built" in r.part for r in [*shard.rows, *plain.rows])
    assert 0 < prow["refresh, one block's weights"].gib < prow["transformer (base)"].gib
    assert shard.total("start") == pytest.approx(sum(r.gib for r in shard.rows if r.when in ("always", "start")))
    tight = memplan.memory_plan(RLConfig(**cfg), gpus=4, gpu_gib=plain.peak_gib / 0.9 * 0.9999)
    assert not tight.fits and tight.sharded_peak_gib == pytest.approx(shard.peak_gib)
    assert any(t.startswith("--set sharding=fsdp under torchrun") for t in tight.advice())

def test_a_sharded_full_fine_tuning_plan_divides_every_trained_tensor():
    """train_mode=full with sharding=fsdp: the trained weights, old + EMA, AdamW, gradients, the stash and the
    reference are 1/gpus per GPU; blocks are gathered in FP32; at start each rank holds the whole FP32 upcast."""
    from solrl_engine.models.tiny.model import load_tiny

    params = sum(p.numel() for p in load_tiny().transformer.parameters())
    cfg = {"name": "t", "model": "tiny", "policy_dtype": "bfloat16", "train_mode": "full", **SIZED}
    plain = memplan.memory_plan(RLConfig(**cfg), gpus=4)
    shard = memplan.memory_plan(RLConfig(**cfg, sharding="fsdp"), gpus=4)
    rows, prow = {r.part: r for r in shard.rows}, {r.part: r for r in plain.rows}
    for part in ("trained weights", "old + EMA policies", "AdamW state", "gradients", "transformer (base)"):
        assert rows[part].gib == pytest.approx(prow[part].gib / 4), part
    assert rows["trained weights' stash"].gib == pytest.approx(4 * params / 4 / 2**30)
    # staged: one block whole on the GPU at start, upcast to FP32 on the CPU just before FSDP2 moves and shards it
    assert rows["a block being sharded"].gib == pytest.approx(rows["gathered blocks"].gib / 2)  # one block, FP32
    assert "gradient all-reduce" in prow and "gradient all-reduce" not in rows
    assert shard.peak_gib < plain.peak_gib and plain.sharded_peak_gib == pytest.approx(shard.peak_gib)
    # HSDP: split over a group (a node), replicated across groups: 16 GPUs in groups of 4 hold what fsdp on 4 does
    hsdp = memplan.memory_plan(RLConfig(**cfg, sharding="hsdp", shard_group_size=4), gpus=16)
    hrows = {r.part: r for r in hsdp.rows}
    for part in ("trained weights", "AdamW state", "transformer (base)", "a block being sharded"):
        assert hrows[part].gib == pytest.approx(rows[part].gib), part
    assert hsdp.sharding == "hsdp" and "sharding=hsdp" in hsdp.render()


def test_the_trainer_refuses_a_plan_that_cannot_fit_before_any_weight_loads(monkeypatch, tmp_path):
    from solrl_engine.rl import trainer as trainer_mod

    monkeypatch.setattr(memplan, "device_memory_gib", lambda device: 0.01)  # as a 10 MiB GPU would report
    loads: list[str] = []
    monkeypatch.setattr(trainer_mod, "build_rollouts", lambda cfg, *run: loads.append(cfg.name) or 1 / 0)
    cfg = RLConfig(name="t", model="tiny", output=str(tmp_path / "run"))
    with pytest.raises(ConfigError, match="does not fit the update in 90% of 0.01 GiB.*memory_check=false"):
        trainer_mod.Trainer(cfg, progress=False)  # auto sizes: not even one sample fits
    assert loads == [] and not (tmp_path / "run").exists()
    with pytest.raises(ConfigError, match="memory plan does not fit this GPU.*memory_check=false") as e:
        trainer_mod.Trainer(RLConfig(name="t", model="tiny", output=str(tmp_path / "run"), **SIZED), progress=False)
    assert "DOES NOT FIT" in str(e.value) and loads == [] and not (tmp_path / "run").exists()
    with pytest.raises(ZeroDivisionError):  # memory_check=false: past the check, on to loading the model
        trainer_mod.Trainer(RLConfig(name="t", model="tiny", memory_check=False), progress=False)
    assert loads == ["t"]


def test_solrl_plan_exits_3_when_it_does_not_fit_and_writes_json(tmp_path, capsys):
    from solrl_engine.cli import main

    assert main(["plan", SPEC, "--gpu-memory", "80", "--json", str(tmp_path / "p.json")]) == 0
    d = json.loads((tmp_path / "p.json").read_text())
    assert d["fits"] and d["model"] == "tiny" and d["gpu_gib"] == 80
    assert main(["plan", SPEC, "--set", "train_mode=full", "--gpu-memory", "0.02"]) == 3
    assert "DOES NOT FIT" in capsys.readouterr().out


def test_published_flux_plan_from_its_config_alone():
    """FLUX.1-dev from its published config, nothing downloaded: 11.9B parameters, and at 1024 px two samples per
    update micro-batch fit an 80 GB GPU only with gradient checkpointing."""
    cfg = RLConfig(name="flux", model="flux", resolution=1024, train_batch_size=2, rollout_batch_size=4,
                   gradient_checkpointing=False)  # fmt: skip
    plan = memplan.memory_plan(cfg, gpu_gib=80)
    assert plan.transformer_params_b == pytest.approx(11.9, abs=0.01)
    assert "FLUX.1-dev" in plan.transformer_source
    assert not plan.fits and any("gradient_checkpointing=true" in t for t in plan.advice())
    ck = memplan.memory_plan(RLConfig(**{**cfg.__dict__, "gradient_checkpointing": True}), gpu_gib=80)
    assert ck.fits


def test_explore_precisions_the_plan_maps_and_a_local_config_from_another_diffusers(tmp_path):
    """te_nvfp4 is planned as NVFP4 (it used to raise "unknown recipe" and would stop every TE run at start); a
    local pipeline's transformer/config.json is read, keys its class does not take dropped (as from_config
    drops them); and the merged policy copy is counted for LoRA with merge_lora, whatever explores."""
    te = memplan.memory_plan(RLConfig(name="t", model="tiny", explore_precision="te_nvfp4"))
    assert "te_nvfp4, stored as nvfp4" in {r.part: r for r in te.rows}["explore copy"].note
    from solrl_engine.models.sana import SanaModel

    small = {**SanaModel.FULL_CONFIG, "num_layers": 1, "num_attention_heads": 2, "attention_head_dim": 16,
             "cross_attention_dim": 32, "caption_channels": 32, "num_cross_attention_heads": 2,
             "cross_attention_head_dim": 16, "_class_name": "SanaTransformer2DModel", "a_key_from_elsewhere": 1}
    (tmp_path / "transformer").mkdir()
    (tmp_path / "transformer" / "config.json").write_text(json.dumps(small))
    cfg = RLConfig(name="s", model="sana", model_path=str(tmp_path), resolution=256, train_batch_size=1,
                   rollout_batch_size=2)  # fmt: skip
    plan = memplan.memory_plan(cfg)
    assert str(tmp_path / "transformer") in plan.transformer_source and plan.transformer_params_b < 0.01
    rows = {r.part: r for r in plan.rows}
    assert rows["merged policy copy"].gib > 0 and "explore copy" in rows


def test_wan22_5b_is_planned_on_its_own_vae_grid():
    """Wan2.2-TI2V-5B's 48-channel latents come from a 16x VAE: a 704 x 1280 clip is 44 x 80 latent cells."""
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    cfg = RLConfig(name="w", model="wan", model_path="Wan-AI/Wan2.2-TI2V-5B-Diffusers", resolution=704, width=1280,
                   frames=121)  # fmt: skip
    model, source = memplan._fake_model(cfg, torch.bfloat16, fake)
    assert "Wan2.2-TI2V-5B" in source and model.latent_shape == (48, 31, 44, 80)


def test_a_checkpoint_from_before_a_key_existed_resumes_at_its_default():
    """A key added after a checkpoint was written (train_mode, memory_check, ...) is compared as its default:
    the run that wrote it ran with that behaviour. A key it holds with another value is still refused."""
    from dataclasses import asdict

    from solrl_engine.rl.guards import check_resume_config

    now = RLConfig(name="t", model="tiny")
    then = asdict(now)
    del then["train_mode"], then["memory_check"]
    check_resume_config(then, now)  # no error
    with pytest.raises(ConfigError, match="train_mode"):
        check_resume_config(then, RLConfig(name="t", model="tiny", train_mode="full"))
