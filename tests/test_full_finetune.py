"""train_mode=full: the DiffusionNFT update on every transformer weight (rl/full.py), through the one trainer.

What is checked: the four weight sets compute what they claim (trained, old, reference = the base as loaded,
EMA), switching swaps storage without copying, the old/EMA decays match LoRA's formulas, the explore copy
refreshes from the whole old policy (quantized layers re-quantized, everything else copied), a run trains,
exports a transformer the stock diffusers class loads, resumes exactly, and `solrl eval` reads its export.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from solrl_engine.models.tiny import TinyConfig, TinyT2I
from solrl_engine.rl.adapters import OLD, TRAIN
from solrl_engine.rl.config import ConfigError, RLConfig
from solrl_engine.rl.full import EMA, REF, FullWeights

SPEC = str(Path(__file__).resolve().parents[1] / "configs/tiny.py:tiny_sol_rl_shapes")
SMALL = TinyConfig(num_layers=1, heads=2, head_dim=16, text_dim=32, text_layers=1)


@pytest.fixture(autouse=True)
def _eager_cpu_sampler(monkeypatch):
    from solrl_engine import hw

    monkeypatch.setattr(hw, "cxx_compiler", lambda *a, **k: None)


def _cfg(small_model: str, out, family: str = "sol_rl", **kw) -> RLConfig:
    base = dict(name=f"full_{family}", family=family, model_path=small_model, n=6, k=4, prompts_per_iter=2,
                preview_steps=2, full_steps=4, iterations=2, eval_every=2, eval_prompt_count=2, eval_seeds=1,
                save_every=1, lr=1e-3, rollout_batch_size=16, train_batch_size=4, timestep_fraction=0.5,
                explore_precision="nvfp4", train_mode="full", kl_beta=0.1, policy_dtype="float32",
                output=str(out))  # fmt: skip
    base.update(kw)
    return RLConfig(**base)


def _transformer(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return TinyT2I(SMALL).transformer.eval()


def _out(net: torch.nn.Module) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 32, 32, generator=g)
    hid, pooled = torch.randn(2, 16, 32, generator=g), torch.randn(2, 32, generator=g)
    with torch.no_grad():
        return net(hidden_states=x, encoder_hidden_states=hid, pooled_projections=pooled,
                   timestep=torch.tensor([500.0, 250.0]), return_dict=False)[0]  # fmt: skip


def _set(w: FullWeights, which: str, fn) -> None:
    with torch.no_grad():
        for t in w.merged_weights(which).values():
            t.copy_(fn(t))


def test_weight_sets_compute_what_they_claim_and_swap_without_copying():
    net = _transformer()
    base = _out(net)
    storage = {n: p.data_ptr() for n, p in net.named_parameters()}
    w = FullWeights(net)
    ref_ptrs = {n: t.data_ptr() for n, t in w.merged_weights(REF).items()}
    assert ref_ptrs == storage  # the reference is the loaded base itself, not a copy
    assert all(p.requires_grad for p in w.params(TRAIN))
    assert all(p.dtype == torch.float32 for p in w.params(TRAIN))
    torch.testing.assert_close(_out(net), base, rtol=0, atol=0)  # trained starts at the base
    gen = torch.Generator().manual_seed(3)
    _set(w, TRAIN, lambda t: t + 0.05 * torch.randn(t.shape, generator=gen))
    _set(w, OLD, lambda t: t - 0.05 * torch.randn(t.shape, generator=gen))
    trained = _out(net)
    with w.using(OLD):
        old = _out(net)
        assert not any(p.requires_grad for p in w.params(TRAIN))
    with w.using(REF):
        torch.testing.assert_close(_out(net), base, rtol=0, atol=0)
    with w.ema_weights():  # the EMA still holds the start: the base
        torch.testing.assert_close(_out(net), base, rtol=0, atol=0)
    torch.testing.assert_close(_out(net), trained, rtol=0, atol=0)  # back to the trained set
    assert (old - trained).abs().max() > 1e-3 and (trained - base).abs().max() > 1e-3
    # a fresh module loaded with the old set's tensors computes exactly what `using(OLD)` computed
    twin = _transformer()
    twin.load_state_dict({**twin.state_dict(), **w.merged_weights(OLD)})
    torch.testing.assert_close(_out(twin), old, rtol=0, atol=0)
    with pytest.raises(ValueError, match="unknown weight set"):
        w.use("nope")
    with pytest.raises(ValueError, match="merge_lora"):
        w.side_branch("any")


def test_old_and_ema_decays_follow_the_lora_formulas():
    w = FullWeights(_transformer())
    theta0 = [t.clone() for t in w.params(TRAIN)]
    gen = torch.Generator().manual_seed(4)
    _set(w, TRAIN, lambda t: t + torch.randn(t.shape, generator=gen))
    theta = [t.detach().clone() for t in w.params(TRAIN)]
    d = w.update_old(200, rate=0.001, max_decay=0.5)
    assert d == pytest.approx(0.2)
    for o, a, b in zip(w.params(OLD), theta0, theta, strict=True):
        torch.testing.assert_close(o, 0.2 * a + 0.8 * b)
    w.update_ema(5, max_decay=0.9)
    de = 6 / 15
    for e, a, b in zip(w.ema, theta0, theta, strict=True):
        torch.testing.assert_close(e, de * a + (1 - de) * b)


def test_state_dict_round_trip_and_a_mismatched_checkpoint_changes_nothing():
    w = FullWeights(_transformer())
    gen = torch.Generator().manual_seed(5)
    _set(w, TRAIN, lambda t: t + torch.randn(t.shape, generator=gen))
    st = w.state_dict()
    assert set(st) == {TRAIN, OLD, EMA}
    w2 = FullWeights(_transformer(seed=1))
    before = [t.clone() for t in w2.params(TRAIN)]
    bad = {k: dict(v) for k, v in st.items()}
    bad[EMA].pop(next(iter(bad[EMA])))
    with pytest.raises(ValueError, match="train_mode=lora"):
        w2.load_state_dict(bad)
    for a, b in zip(w2.params(TRAIN), before, strict=True):
        assert torch.equal(a, b)  # nothing was written
    w2.load_state_dict(st)
    for a, b in zip(w2.params(TRAIN), w.params(TRAIN), strict=True):
        assert torch.equal(a, b)


def test_explore_copy_refreshes_from_the_whole_old_policy():
    from solrl_engine.explore.copy import ExploreCopy
    from solrl_engine.nn.quant_linear import QuantLinear

    net = _transformer()
    copy = ExploreCopy(net, "nvfp4")
    w = FullWeights(net)
    copy.attach(w)
    gen = torch.Generator().manual_seed(6)
    _set(w, OLD, lambda t: t + 0.1 * torch.randn(t.shape, generator=gen))
    n = copy.refresh(w)
    assert n == len(w.names())
    # what the refreshed copy computes equals a fresh copy built from the old weights
    twin = _transformer()
    twin.load_state_dict({**twin.state_dict(), **w.merged_weights(OLD)})
    fresh = ExploreCopy(twin, "nvfp4")
    quantized = [m for m in copy.transformer.modules() if isinstance(m, QuantLinear)]
    assert quantized, "the copy quantizes some layers"
    torch.testing.assert_close(_out(copy.transformer), _out(fresh.transformer), rtol=0, atol=0)
    # and not what the base's copy computed
    assert (_out(copy.transformer) - _out(ExploreCopy(_transformer(), "nvfp4").transformer)).abs().max() > 1e-3


def test_config_refuses_what_full_fine_tuning_cannot_do(tmp_path, small_model):
    with pytest.raises(ConfigError, match="train_mode"):
        _cfg(small_model, tmp_path, train_mode="partial").validate()
    with pytest.raises(ConfigError, match="merge_lora"):
        _cfg(small_model, tmp_path, merge_lora=False).validate()
    with pytest.raises(ConfigError, match="family.*naive_scaling"):
        _cfg(small_model, tmp_path, family="compile").validate()


def test_a_full_run_trains_exports_a_loadable_transformer_and_resumes_exactly(tmp_path, small_model):
    from diffusers import SD3Transformer2DModel

    from solrl_engine.rl.trainer import Trainer

    out = tmp_path / "run"
    tr = Trainer(_cfg(small_model, out, iterations=3), progress=False)
    base = {n: p.detach().clone() for n, p in tr.model.transformer.named_parameters()}
    assert tr.rollouts.sampler.eager_policy and tr.rollout_form == "full"
    summary = tr.run()
    assert summary["train_mode"] == "full" and summary["iterations"] == 3
    assert (out / "transformer_ema").is_dir() and not (out / "lora").exists()
    moved = [n for n, p in tr.model.transformer.named_parameters() if not torch.equal(p.detach(), base[n])]
    assert len(moved) > len(base) // 2, "most weights moved, not only some layers"
    # the stock class loads the export: the EMA weights, at the base's dtype
    loaded = SD3Transformer2DModel.from_pretrained(out / "transformer_ema")
    with tr.adapters.ema_weights():
        for n, p in tr.model.transformer.named_parameters():
            torch.testing.assert_close(loaded.get_parameter(n), p.detach(), rtol=0, atol=0)
    # `solrl verify` checks the full exports with the checkpoints
    from solrl_engine.store.checkpoint import verify_run

    verdicts = {Path(v.path).name: v.status for v in verify_run(out)}
    best = {"transformer_best"} if summary["transformer_best"] else set()  # only when an evaluation beat the base
    assert {"transformer", "transformer_ema", *best} <= set(verdicts) and "lora" not in verdicts, verdicts
    assert set(verdicts.values()) == {"ok"}, verdicts
    # crash-exact resume: 2 iterations then 1 more equals the 3 straight (metrics, weights)
    out2 = tmp_path / "run2"
    Trainer(_cfg(small_model, out2, iterations=2), progress=False).run()
    tr2 = Trainer(_cfg(small_model, out2, iterations=3), progress=False)
    tr2.run(resume=True)
    a = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(line) for line in (out2 / "metrics.jsonl").read_text().splitlines()]
    keys = ("reward_mean", "loss", "kl", "grad_norm", "selection_digest", "heldout_reward")
    assert [[r.get(k) for k in keys] for r in a] == [[r.get(k) for k in keys] for r in b]
    for (n, p), q in zip(tr.model.transformer.named_parameters(), tr2.model.transformer.parameters(), strict=True):
        assert torch.equal(p, q), n
    # a LoRA run's config cannot resume a full run's checkpoint (train_mode decides what comes next)
    with pytest.raises(ConfigError, match="train_mode"):
        Trainer(_cfg(small_model, out2, iterations=4, train_mode="lora", lora_rank=4, lora_alpha=8),
                progress=False).run(resume=True)  # fmt: skip


def test_solrl_eval_reads_a_full_export_and_refuses_a_damaged_one(tmp_path, small_model):
    from solrl_engine.cli import main
    from solrl_engine.models.tiny.model import load_tiny
    from solrl_engine.rl.export import load_trained
    from solrl_engine.rl.trainer import Trainer

    out = tmp_path / "run"
    tr = Trainer(_cfg(small_model, out, family="naive_scaling", iterations=1, eval_every=1), progress=False)
    tr.run()
    net = load_tiny(small_model).transformer
    assert load_trained(net, out / "transformer") == "full"
    for n, p in tr.model.transformer.named_parameters():
        torch.testing.assert_close(net.get_parameter(n), p.detach(), rtol=0, atol=0)

    def argv(d):
        return ["eval", SPEC, "--lora", str(out / "transformer_ema"), "--max-prompts",
                "1", "--seeds", "1", "--output", str(d), "--set", f"model_path={small_model}", "--set", "full_steps=2",
                "--set", "preview_steps=1"]  # fmt: skip

    assert main(argv(tmp_path / "ev")) == 0
    assert json.loads((tmp_path / "ev" / "eval.json").read_text())["lora"] == str(out / "transformer_ema")
    f = out / "transformer_ema" / "diffusion_pytorch_model.safetensors"
    data = bytearray(f.read_bytes())
    data[-64:] = bytes(b ^ 0xFF for b in data[-64:])
    f.write_bytes(bytes(data))
    with pytest.raises(SystemExit, match="transformer_ema is damaged.*SHA-256"):
        main(argv(tmp_path / "ev2"))
    assert not (tmp_path / "ev2").exists()


def test_a_bf16_policy_trains_fp32_weights_against_its_bf16_base(tmp_path, small_model):
    """With a BF16 policy the trained, old and EMA sets are FP32 and the reference stays the BF16 base as loaded:
    the KL term's reference is exactly what the base computes."""
    from solrl_engine.rl.trainer import Trainer

    tr = Trainer(_cfg(small_model, tmp_path / "run", family="naive_scaling", iterations=1, eval_every=1,
                      policy_dtype="bfloat16"), progress=False)  # fmt: skip
    base = {n: p.detach().clone() for n, p in tr.model.transformer.named_parameters()}
    assert {t.dtype for t in base.values()} == {torch.float32}  # the trained set, active
    assert {t.dtype for t in tr.adapters.merged_weights(REF).values()} == {torch.bfloat16}
    m = tr.run()
    assert m["iterations"] == 1 and m["heldout_reward_final"] == m["heldout_reward_final"]  # not NaN
    with tr.adapters.using(REF):
        for n, p in tr.model.transformer.named_parameters():
            assert p.dtype == torch.bfloat16 and torch.equal(p.float(), base[n].to(torch.bfloat16).float()), n


def test_the_policy_samples_eagerly_while_the_explore_copy_stays_compiled(monkeypatch):
    """Full fine-tuning swaps the policy's weight sets, which a compiled (on GPU: captured) graph would not see:
    the sampler routes the policy's own rollouts to the eager sampler and everything else to the compiled one.
    Which path ran is recorded, not assumed."""
    from solrl_engine import hw
    from solrl_engine.models import load_model
    from solrl_engine.sampling import graphed
    from solrl_engine.sampling.graphed import GraphedSampler

    monkeypatch.setattr(hw, "cpu_compile_available", lambda *a, **k: (True, "forced for this test"))
    model = load_model("tiny")
    gs = GraphedSampler(model, cpu_compile=True)
    assert gs.cpu_compile
    ran: list[str] = []
    monkeypatch.setattr(gs, "_sample_cpu", lambda *a, **k: ran.append("compiled") or torch.zeros(1))
    real = graphed.sample
    monkeypatch.setattr(graphed, "sample", lambda *a, **k: ran.append("eager") or real(*a, **k))
    cond = model.encode_prompts(["a red circle"])
    other = torch.nn.Identity()  # stands for the explore copy: any module but the policy's own
    gs.eager_policy = True
    gs.sample(cond, [0], 2)
    gs.sample(cond, [0], 2, transformer=model.transformer)
    gs.sample(cond, [0], 2, transformer=other)
    assert ran == ["eager", "eager", "compiled"]
    gs.eager_policy = False  # LoRA training: the policy's rollouts compile as before
    gs.sample(cond, [0], 2)
    assert ran[-1] == "compiled"


def test_gradient_checkpointing_changes_memory_not_the_update(tmp_path, small_model):
    """Full fine-tuning with gradient checkpointing: the recompute in the backward runs with the trained set
    active (the policies are swapped only around no-grad forwards), so the update equals the one without."""
    from solrl_engine.rl.trainer import Trainer

    runs = []
    for ckpt in (False, True):
        tr = Trainer(_cfg(small_model, tmp_path / f"ck{ckpt}", family="naive_scaling", iterations=1, eval_every=1,
                          gradient_checkpointing=ckpt), progress=False)  # fmt: skip
        m = tr.step()
        runs.append((m, [p.detach().clone() for p in tr.model.transformer.parameters()]))
    (a, wa), (b, wb) = runs
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-5) and b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
    for x, y in zip(wa, wb, strict=True):
        torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-6)
    from solrl_engine.models.tiny.model import load_tiny

    base = list(load_tiny(small_model).transformer.parameters())
    assert sum(not torch.equal(x, y) for x, y in zip(wa, base, strict=True)) > len(base) // 2  # the update ran
