"""The trainer end to end on a small random tiny model: every family, resume, the explore copy."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from cpu_branches import BRANCHES, dtype_name, force_cpu_bf16

from solrl_engine.explore import choice
from solrl_engine.rl import ConfigError, RLConfig
from solrl_engine.rl.trainer import Trainer

TIME_KEYS = {"time_explore_s", "time_regen_s", "time_train_s", "time_total_s", "time_reward_hidden_s",
             "time_reward_exposed_s"}


@pytest.fixture(autouse=True)
def _eager_cpu_sampler(monkeypatch):
    """The `compile` family samples eagerly here (the fallback without a C++ compiler), so it must match
    naive_scaling bit for bit; the inductor path has its own tests (test_cpu_runtime.py)."""
    from solrl_engine import hw

    monkeypatch.setattr(hw, "cxx_compiler", lambda *a, **k: None)


@pytest.fixture(params=BRANCHES)
def cpu_policy(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> torch.dtype:
    """Both outcomes of the CPU's BF16 detection (tests/cpu_branches.py): the policy dtype of the run."""
    return force_cpu_bf16(monkeypatch, request.param == "bf16")


def _cfg(small_model: str, out, family: str = "sol_rl", **kw) -> RLConfig:
    base = dict(
        name=f"t_{family}",
        family=family,
        model_path=small_model,
        n=6,
        k=4,
        prompts_per_iter=2,
        preview_steps=2,
        full_steps=4,
        iterations=2,
        eval_every=2,
        eval_prompt_count=2,
        eval_seeds=1,
        save_every=1,
        lora_rank=4,
        lora_alpha=8,
        lr=1e-2,
        rollout_batch_size=16,
        train_batch_size=4,
        timestep_fraction=0.5,
        explore_precision="nvfp4",  # the quantized explore copy (auto on a CPU explores with the policy itself)
        output=str(out),
    )
    base.update(kw)
    if family == "diffusionnft":
        base["n"] = base["k"]
    return RLConfig(**base)


def _records(out) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("family", ["sol_rl", "naive_scaling", "compile", "naive_quant", "diffusionnft"])
def test_every_family_runs_and_writes_its_artifacts(small_model, tmp_path, family, cpu_policy):
    summary = Trainer(_cfg(small_model, tmp_path, family), progress=False).run()
    recs = _records(tmp_path)
    assert [r["iter"] for r in recs] == [1, 2]
    for r in recs:
        assert 0 <= r["reward_mean"] <= 1 and r["loss"] == r["loss"]  # finite
        assert TIME_KEYS <= set(r)
        has_proxy = family == "sol_rl"
        assert (r["proxy_spearman"] is not None) == has_proxy and (r["proxy_kendall"] is not None) == has_proxy
        assert (r["proxy_reward_mean"] is not None) == (family in ("sol_rl", "naive_quant"))
    assert "heldout_reward" in recs[-1]
    for f in ("reward.png", "eval_00000.png", "eval_00002.png", "compare.png", "summary.json", "config.json"):
        assert (tmp_path / f).exists(), f
    assert summary["iterations"] == 2 and summary["heldout_reward_start"] is not None
    # the gain is paired with the first evaluation (same prompts, same seeds): its mean is the difference
    # of the means, its standard error that of the per-image differences
    gain = recs[-1]["heldout_gain"]
    assert gain == pytest.approx(recs[-1]["heldout_reward"] - summary["heldout_reward_start"], abs=1e-6)
    assert summary["heldout_gain_final"] == gain and recs[-1]["heldout_gain_stderr"] >= 0
    policy = f"policy ({dtype_name(cpu_policy)})"  # what the CPU's BF16 detection chose
    assert summary["explore_recipe"] == ("nvfp4" if family in ("sol_rl", "naive_quant") else policy)


def test_families_differ_only_where_they_should(small_model, tmp_path):
    # compile falls back to eager here (no C++ compiler, see _eager_cpu_sampler): it reproduces naive_scaling
    a = Trainer(_cfg(small_model, tmp_path / "a", "naive_scaling", iterations=1), progress=False)
    b = Trainer(_cfg(small_model, tmp_path / "b", "compile", iterations=1), progress=False)
    a.run()
    b.run()
    ra, rb = _records(tmp_path / "a")[0], _records(tmp_path / "b")[0]
    for key in ("reward_mean", "explore_reward_mean", "loss"):
        assert ra[key] == rb[key], key
    # sol_rl explores the same seeds as naive_quant (same prompts, same seed stream) but at fewer
    # steps, and trains on BF16 regenerations instead of the quantized samples
    q = Trainer(_cfg(small_model, tmp_path / "q", "naive_quant", iterations=1), progress=False)
    s = Trainer(_cfg(small_model, tmp_path / "s", "sol_rl", iterations=1), progress=False)
    assert q.prompt_sampler.next(2) == s.prompt_sampler.next(2)
    q.run()
    s.run()
    rq, rs = _records(tmp_path / "q")[0], _records(tmp_path / "s")[0]
    assert rq["explore_reward_mean"] != rs["explore_reward_mean"]


def test_resume_continues_with_the_same_metrics(small_model, tmp_path):
    full = tmp_path / "full"
    Trainer(_cfg(small_model, full, iterations=4, eval_every=2), progress=False).run()
    part = tmp_path / "part"
    Trainer(_cfg(small_model, part, iterations=2, eval_every=2), progress=False).run()
    # an interrupted run: a record past the last checkpoint must be dropped on resume
    with (part / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"iter": 3, "reward_mean": -1}) + "\n")
    Trainer(_cfg(small_model, part, iterations=4, eval_every=2), progress=False).run(resume=True)
    want, got = _records(full), _records(part)
    assert [r["iter"] for r in got] == [1, 2, 3, 4]
    for w, g in zip(want, got, strict=True):
        for key in set(w) - TIME_KEYS - {"grad_norm"}:
            if isinstance(w[key], float):
                assert g[key] == pytest.approx(w[key], rel=1e-4, abs=1e-6), key
            else:
                assert g[key] == w[key], key


def test_update_changes_the_policy_and_requantize_changes_the_explore_copy(small_model, tmp_path, cpu_policy):
    tr = Trainer(_cfg(small_model, tmp_path, lr=5e-2, iterations=1), progress=False)
    assert tr.rollouts.dtype == cpu_policy
    x = torch.randn(2, 3, 32, 32)  # FP32 latents, no autocast: the model casts them to its dtype
    cond = tr.model.encode_prompts(["a red circle", "a blue square"])
    t = torch.tensor([0.5, 0.5])
    with torch.no_grad():
        before = tr.model.velocity(x, t, cond, transformer=tr.explore.transformer)
        buffers = [b.data_ptr() for b in tr.explore.transformer.buffers()]
    tr.step()
    tr.step()  # the second update moves "old" (d > 0 only matters for how far)
    with torch.no_grad():
        after = tr.model.velocity(x, t, cond, transformer=tr.explore.transformer)
    assert not torch.allclose(before, after)
    assert [b.data_ptr() for b in tr.explore.transformer.buffers()] == buffers  # rewritten in place


def test_side_branch_tracks_the_merged_copy(small_model, tmp_path, cpu_policy):
    merged = Trainer(_cfg(small_model, tmp_path / "m", lr=5e-2), progress=False)
    side = Trainer(_cfg(small_model, tmp_path / "s", lr=5e-2, merge_lora=False), progress=False)
    side.adapters.load_state_dict(merged.adapters.state_dict())
    merged.step()
    side.adapters.load_state_dict(merged.adapters.state_dict())
    merged.explore.refresh(merged.adapters)
    x = torch.randn(2, 3, 32, 32)
    cond = merged.model.encode_prompts(["a red circle", "a blue square"])
    t = torch.tensor([0.6, 0.3])
    with torch.no_grad():
        vm = merged.model.velocity(x, t, cond, transformer=merged.explore.transformer)
        vs = side.model.velocity(x, t, cond, transformer=side.explore.transformer)
        with merged.adapters.using("old"):
            v_bf16 = merged.model.velocity(x, t, cond)
    # both approximate the BF16 "old" policy; they differ only by where NVFP4 rounding falls
    assert (vm - v_bf16).norm() / v_bf16.norm() < 0.3
    assert (vs - v_bf16).norm() / v_bf16.norm() < 0.3


def test_bad_config_fails_before_any_work(small_model, tmp_path):
    with pytest.raises(ValueError, match="even"):
        Trainer(dataclasses.replace(_cfg(small_model, tmp_path), k=3), progress=False)
    with pytest.raises(FileNotFoundError, match="pretrain-tiny"):
        Trainer(_cfg(str(tmp_path / "nowhere"), tmp_path), progress=False)


def test_explore_skip_keeps_more_layers_out_of_the_quantized_copy(small_model, tmp_path):
    tr = Trainer(_cfg(small_model, tmp_path, explore_skip=("*attn.to_q",)), progress=False)
    skipped = tr.explore.report.skipped
    assert any(name.endswith("attn.to_q") and "skip pattern" in why for name, why in skipped.items())
    assert not any(name.endswith("attn.to_q") for name in tr.explore.report.quantized)


def test_explore_copy_shares_the_frozen_base_and_keeps_its_own_lora_layers(small_model, tmp_path):
    tr = Trainer(_cfg(small_model, tmp_path, lr=5e-2), progress=False)
    ex, pol = tr.explore.transformer, tr.model.transformer
    assert tr.explore.shared_bytes > 0
    shared = dict(ex.named_parameters())
    base = {n.replace(".base_layer.", "."): t for n, t in pol.named_parameters() if ".lora_" not in n}
    # a frozen high-precision layer (an adaLN modulation) is the policy's own storage ...
    name = "transformer_blocks.0.norm1.linear.weight"
    assert shared[name].data_ptr() == base[name].data_ptr()
    # ... while a LoRA layer kept in high precision holds the merged weight, its own storage
    name = "transformer_blocks.0.attn.to_q.weight"
    assert shared[name].data_ptr() != base[name].data_ptr()
    # the copies were built borrowing the base's storage (no second whole copy at start) and refreshed: the
    # base is still bit for bit what was loaded, and stays so through updates and refreshes
    from solrl_engine.models import load_model

    loaded = dict(load_model("tiny", small_model, "cpu", tr.dtype).transformer.named_parameters())
    assert all(torch.equal(loaded[n], t) for n, t in base.items())
    tr.step()
    tr.step()
    assert all(torch.equal(loaded[n], t) for n, t in base.items())  # the policy's base is untouched by refresh
    merged = tr.adapters.merged_weights("old")[name]
    torch.testing.assert_close(shared[name], merged)  # the explore copy follows the old adapter


def test_sol_rl_explores_with_the_policy_when_no_quantized_precision_is_faster(
    small_model, tmp_path, monkeypatch, cpu_policy
):
    """explore_precision=auto on a CPU where every emulated format is slower: no copy is built, the
    policy previews at preview_steps, and the proxy statistics are still those of the previews."""

    slow = {"policy": 1.0, **{k: 3.0 for k in choice.EXPLORE_CANDIDATES}}
    monkeypatch.setattr(choice, "probe_explore_timings", lambda *a, **k: dict(slow))
    tr = Trainer(_cfg(small_model, tmp_path, explore_precision="auto"), progress=False)
    assert tr.explore is None and tr.explore_spec.precision == choice.POLICY
    # like-for-like with a quantized copy: the policy previews as its copy with the old LoRA merged
    assert tr.explorer.transformer is tr.policy_copy.transformer and tr.explorer.steps == 2  # preview_steps
    assert tr.explorer.tag == "old-merged" and tr.rollout_form == "merged"
    summary = tr.run()
    assert summary["explore_recipe"] == f"policy ({dtype_name(cpu_policy)})"
    assert not (tmp_path / "quantization.txt").exists()
    for r in _records(tmp_path):
        assert -1 <= r["proxy_spearman"] <= 1 and r["proxy_reward_mean"] is not None and r["time_regen_s"] > 0


def test_updates_per_iter_takes_that_many_optimizer_steps(small_model, tmp_path):
    tr = Trainer(_cfg(small_model, tmp_path, updates_per_iter=2, eval_train_prompt_count=3), progress=False)
    m = tr.step()
    assert all(st["step"].item() == 2 for st in tr.opt.state.values())  # two Adam steps in one iteration
    assert m["old_decay"] == pytest.approx(min(0.001 * 2, 0.5))  # the old adapter's decay counts optimizer steps
    assert m["loss"] == m["loss"] and m["grad_norm"] >= 0
    with pytest.raises(ConfigError, match="updates_per_iter"):
        _cfg(small_model, tmp_path, updates_per_iter=0).validate()
    tr.evaluate()  # training prompts beside the held-out ones
    assert len(tr.eval_train_prompts) == 3 and set(tr.eval_train_prompts) <= set(tr.train_prompts)
    assert len(tr.train_evals) == 1 and 0 <= tr.train_evals[0][1] <= 1


def test_resume_keeps_the_explore_precision_the_run_was_timed_into(small_model, tmp_path, monkeypatch):
    """explore_precision=auto is timed at start; a resumed run explores as its checkpoint says, here
    rebuilding the NVFP4 copy from the adapted policy although this start's timings chose the policy."""

    fast = {"policy": 1.0, "nvfp4": 0.5}
    monkeypatch.setattr(choice, "probe_explore_timings", lambda *a, **k: dict(fast))
    kw = dict(explore_precision="auto", iterations=4, eval_every=2)
    Trainer(_cfg(small_model, tmp_path / "full", **kw), progress=False).run()
    Trainer(_cfg(small_model, tmp_path / "part", **{**kw, "iterations": 2}), progress=False).run()
    fast["nvfp4"] = 3.0  # this start would explore with the policy
    tr = Trainer(_cfg(small_model, tmp_path / "part", **kw), progress=False)
    assert tr.explore is None
    tr.run(resume=True)
    assert tr.explore is not None and tr.explore.recipe == "nvfp4" and tr.explorer.transformer is tr.explore.transformer
    want, got = _records(tmp_path / "full"), _records(tmp_path / "part")
    for w, g in zip(want[2:], got[2:], strict=True):
        assert g["selection_digest"] == w["selection_digest"]
        for key in ("reward_mean", "explore_reward_mean", "proxy_spearman", "loss"):
            assert g[key] == pytest.approx(w[key], rel=1e-4, abs=1e-6), key
    # the checkpoint's choice set explicitly resumes too (what a sharded run's refusal tells its user to do);
    # another explicit precision is still refused
    fast["nvfp4"] = 0.5  # auto chooses NVFP4 again
    Trainer(_cfg(small_model, tmp_path / "again", **{**kw, "iterations": 2}), progress=False).run()
    with pytest.raises(ConfigError, match="explore_precision"):
        Trainer(_cfg(small_model, tmp_path / "again", **{**kw, "explore_precision": "fp8"}), progress=False).run(
            resume=True)
    Trainer(_cfg(small_model, tmp_path / "again", **{**kw, "explore_precision": "nvfp4"}), progress=False).run(
        resume=True)
    assert [r["iter"] for r in _records(tmp_path / "again")] == [1, 2, 3, 4]


def test_best_heldout_adapter_is_kept_and_a_degrading_policy_is_reported(small_model, tmp_path, caplog):
    """OUT/lora_best is the EMA adapter of the best held-out evaluation (never the base model's, never the
    live adapter), survives later worse evaluations, and a fall of more than 3 paired standard errors
    below it is reported with what to change; a fall inside the noise is not."""
    from safetensors.torch import load_file

    from solrl_engine.rl.export import WEIGHT_NAME, save_lora
    from solrl_engine.store.checkpoint import BEST_INFO, BEST_LORA

    tr = Trainer(_cfg(small_model, tmp_path, iterations=6), progress=False)
    best = tmp_path / BEST_LORA
    gen = torch.Generator().manual_seed(1)
    base = torch.rand(64, generator=gen)
    noise = 0.01 * torch.randn(64, generator=gen)
    tr.heldout.track_best(tr.iteration, base)  # iteration 0: the base model is the best so far: nothing exported
    assert tr.best[0] == 0 and not best.exists()
    with torch.no_grad():  # an EMA that differs from the live adapter, to tell which one is exported
        for e in tr.adapters.ema:
            e.add_(torch.randn(e.shape, generator=gen))
    tr.iteration = 2
    tr.heldout.track_best(tr.iteration, base + 0.1 + noise)
    assert json.loads((best / BEST_INFO).read_text())["iteration"] == 2
    save_lora(tr.adapters, tmp_path / "ema_now", tr.rollouts.spec.pipeline, ema=True)
    save_lora(tr.adapters, tmp_path / "live_now", tr.rollouts.spec.pipeline)
    got = load_file(best / WEIGHT_NAME)
    ema, live = load_file(tmp_path / "ema_now" / WEIGHT_NAME), load_file(tmp_path / "live_now" / WEIGHT_NAME)
    assert got.keys() == ema.keys() and all(torch.equal(got[k], ema[k]) for k in got)
    assert not all(torch.equal(got[k], live[k]) for k in got)

    with torch.no_grad():  # a worse evaluation that exported anyway would now write zeros
        for e in tr.adapters.ema:
            e.zero_()
    tr.iteration = 4
    with caplog.at_level("WARNING"):
        wobble = 0.002 * torch.randn(64, generator=gen)
        # 0.0003 below, se ~0.00025: noise
        tr.heldout.track_best(tr.iteration, base + 0.1 + noise - 0.0003 + wobble - wobble.mean())
    assert "degrading" not in caplog.text and tr.best[0] == 2
    tr.iteration = 6
    with caplog.at_level("WARNING"):
        # 0.05 below, se ~0.0003
        tr.heldout.track_best(tr.iteration, base + 0.05 + noise + 0.002 * torch.randn(64, generator=gen))
    assert "iteration 6" in caplog.text and "degrading" in caplog.text and str(best) in caplog.text
    assert "kl_beta=0.1" in caplog.text and "lr=3e-4" in caplog.text
    assert tr.best[0] == 2 and json.loads((best / BEST_INFO).read_text())["iteration"] == 2
    assert all(torch.equal(load_file(best / WEIGHT_NAME)[k], got[k]) for k in got)  # untouched by worse evals


def test_resume_drops_a_best_adapter_written_after_its_checkpoint(small_model, tmp_path):
    """A run stopped between an evaluation that wrote lora_best and the next checkpoint resumes with the
    checkpoint's idea of the best: a lora_best from the lost iterations is removed, a matching one kept."""
    from solrl_engine.store.checkpoint import BEST_INFO, BEST_LORA

    Trainer(_cfg(small_model, tmp_path, iterations=2, eval_every=1, save_every=1), progress=False).run()
    summary = json.loads((tmp_path / "summary.json").read_text())
    it = summary["heldout_best_iteration"]
    best = tmp_path / BEST_LORA
    assert best.exists() == (it > 0) and (summary["lora_best"] is not None) == (it > 0)
    best.mkdir(exist_ok=True)
    (best / BEST_INFO).write_text(json.dumps({"iteration": it}))
    Trainer(_cfg(small_model, tmp_path, iterations=2, eval_every=1, save_every=1), progress=False).run(resume=True)
    assert best.exists()  # it matches the checkpoint's best: kept
    (best / BEST_INFO).write_text(json.dumps({"iteration": 7}))  # as if written after the last checkpoint
    Trainer(_cfg(small_model, tmp_path, iterations=2, eval_every=1, save_every=1), progress=False).run(resume=True)
    assert not best.exists()
    best.mkdir()  # a torn info file (a crash while it was written) is unknown: removed, and resume goes on
    (best / BEST_INFO).write_text('{"iterat')
    Trainer(_cfg(small_model, tmp_path, iterations=2, eval_every=1, save_every=1), progress=False).run(resume=True)
    assert not best.exists()


def test_the_update_trains_without_cudnn_attention_and_rollouts_keep_torchs_choice(small_model, tmp_path,
                                                                                    monkeypatch):  # fmt: skip
    """FLUX.1-dev's update failed in cuDNN's attention on an H200 (hw.training_attention): every attention the
    update runs with gradients must have cuDNN's SDPA backend off, and the rollouts' (no gradients) keep it."""
    import torch.nn.functional as F

    seen: list[tuple[bool, bool]] = []
    sdpa = F.scaled_dot_product_attention

    def spy(*a, **k):  # noqa: ANN002, ANN003, ANN202
        seen.append((torch.is_grad_enabled(), torch.backends.cuda.cudnn_sdp_enabled()))
        return sdpa(*a, **k)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    Trainer(_cfg(small_model, tmp_path, iterations=1), progress=False).step()
    train = {cudnn for grad, cudnn in seen if grad}
    rollout = {cudnn for grad, cudnn in seen if not grad}
    assert train == {False} and True in rollout, seen[:5]
    assert torch.backends.cuda.cudnn_sdp_enabled()  # restored after the update


def test_a_sharded_full_run_keeps_no_cached_casts_and_its_reference_is_its_own(small_model, tmp_path, monkeypatch):
    """sharding=fsdp with train_mode=full (one process: the same paths as on many ranks). Its FP32 weights are
    gathered block by block, so autocast must not cache their BF16 casts for the rest of a forward (they would
    pile up to the whole model); an unsharded run keeps the cache. And the reference set is its own tensors even
    when the base is FP32 (`to` returns the tensor itself for a matching dtype)."""
    import torch.nn.functional as F

    from solrl_engine.rl.adapters import TRAIN
    from solrl_engine.rl.full import REF

    dtype = force_cpu_bf16(monkeypatch, True)
    seen: list[tuple[bool, bool]] = []
    sdpa = F.scaled_dot_product_attention

    def spy(*a, **k):  # noqa: ANN002, ANN003, ANN202
        if torch.is_autocast_enabled("cpu"):
            seen.append((torch.is_grad_enabled(), torch.is_autocast_cache_enabled()))
        return sdpa(*a, **k)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    for sharding, cached in (("fsdp", False), ("none", True)):
        seen.clear()
        tr = Trainer(_cfg(small_model, tmp_path / sharding, "naive_scaling", iterations=1, train_mode="full",
                          lr=1e-3, sharding=sharding), progress=False)  # fmt: skip
        assert tr.dtype == dtype == torch.bfloat16
        tr.step()
        assert seen and {c for _, c in seen} == {cached}, (sharding, seen[:3])
    fp32 = Trainer(_cfg(small_model, tmp_path / "fp32", "naive_scaling", iterations=1, train_mode="full", lr=1e-3,
                        sharding="fsdp", policy_dtype="float32"), progress=False)  # fmt: skip
    ref, trained = fp32.adapters.params(REF), fp32.adapters.params(TRAIN)
    assert all(r.data_ptr() != t.data_ptr() for r, t in zip(ref, trained, strict=True))
    before = [r.clone() for r in ref]
    fp32.step()
    assert all(torch.equal(b, r) for b, r in zip(before, ref, strict=True))  # the reference never moves
    assert any(not torch.equal(b, t) for b, t in zip(before, trained, strict=True))  # the trained weights did
