"""The drop-in rollout backend (solrl_engine.explore.Explorer) on tiny pipelines of the real classes:
it selects what our trainer selects, its noise regenerates through the stock pipeline the image our
trainer regenerates, sync_ makes the explore copy equal a fresh one of the updated policy, and the
caller's pipeline is never changed."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from cpu_branches import BRANCHES, force_cpu_bf16
from tiny_pipelines import SIZES, build_clip_reward, build_flux, build_sana, build_sd3

from solrl_engine.explore import Explorer
from solrl_engine.explore.ranking import select_contrastive
from solrl_engine.rl.config import load_config
from solrl_engine.rl.trainer import Trainer

BUILDERS = {"sd3": build_sd3, "flux": build_flux, "sana": build_sana}
PRESET = {"sd3": "configs/sd3.py:sd3_sol_rl_clipscore", "flux": "configs/flux1.py:flux1_sol_rl_clipscore",
          "sana": "configs/sana.py:sana_sol_rl_clipscore"}  # fmt: skip
# the stock pipeline's own scheduler step is Euler (SD3, FLUX) or DPM-Solver++ 2M (SANA): ours must match it
SOLVER = {"sd3": "euler", "flux": "euler", "sana": "dpm2"}
ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["a red apple", "a blue car"]


@pytest.fixture(scope="module")
def pipes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("xpipes")
    out = {name: build(root / name) for name, build in BUILDERS.items()}
    out["clip"] = build_clip_reward(root / "clip")
    return out


def _stock(name: str, path: Path, dtype: torch.dtype = torch.float32):  # noqa: ANN202 - a diffusers pipeline
    import diffusers

    from solrl_engine.models import model_spec

    pipe = getattr(diffusers, model_spec(name).pipeline).from_pretrained(path, torch_dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _trainer(name: str, pipes: dict[str, Path], out: Path) -> Trainer:
    sets = [f"model_path={pipes[name]}", f"resolution={SIZES[name]}", f"reward_args=clipscore.model={pipes['clip']}",
            "n=6", "k=4", "prompts_per_iter=2", "preview_steps=2", "full_steps=3", f"solver={SOLVER[name]}",
            "explore_precision=nvfp4", "device=cpu", "lora_rank=4", "lora_alpha=8", f"output={out}"]  # fmt: skip
    return Trainer(load_config(str(ROOT / PRESET[name]), sets), progress=False)


@pytest.mark.parametrize("branch", BRANCHES)
@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_explorer_selects_and_regenerates_what_the_trainer_does(name, pipes, tmp_path, monkeypatch, branch):
    """The trainer's policy dtype follows the CPU (both branches forced here); the caller's pipeline
    is loaded in that dtype, so both explore the same numbers."""
    dtype = force_cpu_bf16(monkeypatch, branch == "bf16")
    tr = _trainer(name, pipes, tmp_path)
    assert tr.rollouts.dtype == dtype
    pipe = _stock(name, pipes[name], dtype)
    before = {k: v.clone() for k, v in pipe.transformer.state_dict().items()}
    ex = Explorer(pipe, tr.reward, n=6, k=4, preview_steps=2, explore_precision="nvfp4", solver=SOLVER[name],
                  resolution=SIZES[name])  # fmt: skip
    seeds = [[11, 22, 33, 44, 55, 66], [7, 8, 9, 10, 12, 13]]
    sel = ex.select(PROMPTS, seeds)
    with tr.adapters.using("old"):
        want = tr.explorer.select(PROMPTS, seeds)
    assert sel.seeds == want.seeds and len(sel.seeds[0]) == 4
    torch.testing.assert_close(sel.proxy_rewards, want.proxy_rewards, rtol=1e-5, atol=1e-5)  # the same path
    # top K/2 first, then bottom K/2; ranks among the N explored
    assert sel.ranks[:, :2].max() < 2 and sel.ranks[:, 2:].min() >= 4
    assert sel.noise.shape[0] == 8
    # the stock pipeline, fed the returned noise, draws the trainer's full-precision regeneration
    regen = sel.regenerate(pipe, steps=3)
    with tr.adapters.using("old"), torch.no_grad():
        x0 = tr._sample(tr.rollouts.encode(sel.flat_prompts), sel.flat_seeds, 3)
        ours = tr.model.decode(x0)
    assert regen.images.shape == ours.shape and regen.rewards.shape == (2, 4)
    if dtype == torch.float32:
        torch.testing.assert_close(regen.images, ours, rtol=2e-4, atol=2e-4)
    else:  # the stock pipeline runs BF16 without autocast (its norms in BF16 too), ours under autocast:
        # they agree to BF16 rounding, about one 8-bit grey level in RMS, with a rare pixel further off
        d = (regen.images - ours).float()
        assert d.square().mean().sqrt() < 2**-7 and (d.abs() > 2**-4).float().mean() < 1e-3
    fid = sel.fidelity(regen.rewards)
    assert -1 <= fid["spearman"] <= 1 and len(fid["per_prompt_kendall"]) == 2
    # the caller's pipeline is untouched
    after = pipe.transformer.state_dict()
    assert set(after) == set(before) and all(torch.equal(before[k], after[k]) for k in before)


def test_explorer_over_a_bf16_pipeline_takes_fp32_latents_and_conditioning(pipes):
    """A caller with a BF16 pipeline hands the explorer FP32 tensors (its own noise, its own
    conditioning): the explorer's model casts them as the stock pipeline does, instead of failing in
    the patch embedding's conv."""
    pipe = _stock("sd3", pipes["sd3"], torch.bfloat16)
    reward = lambda images, prompts: images.mean(dim=(1, 2, 3))  # noqa: E731 - any callable works
    ex = Explorer(pipe, reward, n=4, k=2, preview_steps=2, explore_precision="nvfp4", resolution=SIZES["sd3"])
    x, t = torch.randn(2, *ex.model.latent_shape), torch.tensor([0.6, 0.3])
    cond = ex.model.encode_prompts(PROMPTS).to(torch.float32)
    with torch.no_grad():
        for net in (None, ex.transformer):  # the policy and the quantized explore copy
            v = ex.model.velocity(x, t, cond, transformer=net)
            assert v.dtype == torch.bfloat16 and torch.isfinite(v).all()
            assert torch.equal(v, ex.model.velocity(x.bfloat16(), t, cond.to(torch.bfloat16), transformer=net))
    sel = ex.select(PROMPTS, [[1, 2, 3, 4], [5, 6, 7, 8]], cond=cond)
    assert len(sel.seeds[0]) == 2 and torch.isfinite(sel.proxy_rewards).all()
    regen = sel.regenerate(pipe, steps=2)  # FP32 noise into the BF16 pipeline's latents=
    assert regen.rewards.shape == (2, 2) and torch.isfinite(regen.images).all()


def test_sync_makes_the_explore_copy_equal_a_fresh_one_of_the_updated_policy(pipes):
    from peft import LoraConfig

    from solrl_engine.nn import QuantLinear

    pipe = _stock("sd3", pipes["sd3"])
    reward = lambda images, prompts: images.mean(dim=(1, 2, 3))  # noqa: E731 - any callable works
    ex = Explorer(pipe, reward, n=4, k=2, preview_steps=2, explore_precision="nvfp4", resolution=SIZES["sd3"])
    pipe.transformer.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=["ff.net.0.proj", "attn.to_q"]))
    with torch.no_grad():
        for n, p in pipe.transformer.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.3)  # "the caller's update"
    buffers = [b.data_ptr() for b in ex.transformer.buffers()]
    assert ex.sync_(pipe) > 0
    assert [b.data_ptr() for b in ex.transformer.buffers()] == buffers  # in place: graphs stay valid
    fresh = Explorer(pipe, reward, n=4, k=2, preview_steps=2, explore_precision="nvfp4", resolution=SIZES["sd3"])
    for (name, a), (_, b) in zip(ex.transformer.named_modules(), fresh.transformer.named_modules(), strict=True):
        if isinstance(a, QuantLinear):
            assert torch.equal(a.w_qdata, b.w_qdata), name
    x = torch.randn(2, *ex.model.latent_shape)
    cond = ex.model.encode_prompts(PROMPTS)
    with torch.no_grad():
        va = ex.model.velocity(x, torch.tensor([0.6, 0.3]), cond, transformer=ex.transformer)
        vb = fresh.model.velocity(x, torch.tensor([0.6, 0.3]), cond, transformer=fresh.transformer)
    torch.testing.assert_close(va, vb, rtol=0, atol=0)
    sel = ex.select(["a red apple"])  # seeds drawn from the explorer's own seeded generator
    assert len(sel.all_seeds[0]) == 4 and len(sel.seeds[0]) == 2


def test_explorer_refuses_what_it_cannot_use(pipes):
    with pytest.raises(TypeError, match="not a pipeline"):
        Explorer(object(), lambda i, p: i.mean((1, 2, 3)))
    pipe = _stock("sd3", pipes["sd3"])
    ex = Explorer(copy.copy(pipe), lambda i, p: i.mean((1, 2, 3)), n=4, k=2, preview_steps=2, resolution=64)
    with pytest.raises(ValueError, match="4 seeds"):
        ex.select(["a"], [[1, 2, 3]])


def test_a_borrowing_copy_holds_no_second_copy_and_copies_on_write(small_model):
    """ExploreCopy(borrow=True), what the trainer builds: its high-precision tensors are the base's own storage
    (new frozen Parameter objects, marked), quantized layers hold only their quantized buffers; a requantize_
    that writes a borrowed tensor gives it its own storage first, so the base never changes."""
    from solrl_engine.explore.choice import POLICY
    from solrl_engine.explore.copy import ExploreCopy
    from solrl_engine.models import load_model
    from solrl_engine.nn import QuantLinear, requantize_
    from solrl_engine.nn.quantize import BORROWED

    base = load_model("tiny", small_model, "cpu", torch.float32).transformer
    want = {n: p.detach().clone() for n, p in base.named_parameters()}
    src = dict(base.named_parameters())
    for recipe in (POLICY, "fp8"):
        cp = ExploreCopy(base, recipe, borrow=True)
        quant = {n for n, m in cp.transformer.named_modules() if isinstance(m, QuantLinear)}
        assert (recipe == "fp8") == bool(quant)
        for n, p in cp.transformer.named_parameters():
            assert p is not src[n] and not p.requires_grad  # its own Parameter objects, frozen ...
            assert p.data_ptr() == src[n].data_ptr() and getattr(p, BORROWED)  # ... on the base's storage
        assert cp.borrowed_bytes == sum(p.numel() * p.element_size() for p in cp.transformer.parameters())
        name = next(n for n, _ in cp.transformer.named_parameters() if n.endswith("norm1.linear.weight"))
        if name.rpartition(".")[0] in quant:
            continue
        new = torch.randn_like(src[name])
        requantize_(cp.transformer, source={name: new}, strict=False)
        written = dict(cp.transformer.named_parameters())[name]
        assert torch.equal(written, new) and written.data_ptr() != src[name].data_ptr()
        assert not getattr(written, BORROWED, False)
        assert all(torch.equal(want[n], p) for n, p in base.named_parameters())  # the base never changed
    deep = ExploreCopy(base, POLICY)  # the default (the public Explorer's): a deep copy, nothing borrowed
    assert deep.borrowed_bytes == 0


def test_several_rewards_are_normalised_within_each_prompt_group_before_weighting(pipes):
    """reward_combine=group_normalized: a reward of large spread (brightness x 100) no longer decides the ranking
    alone; each reward is normalised within its prompt group, then weighted. The sum keeps today's behaviour. The
    explorer ranks by that value and keeps the weighted sums for the metrics."""
    from solrl_engine.rewards import WeightedReward

    loud = lambda images, prompts: 100 * images.mean(dim=(1, 2, 3))  # noqa: E731
    quiet = lambda images, prompts: images[:, 0].std(dim=(1, 2))  # noqa: E731 - red contrast, a small spread
    g = torch.Generator().manual_seed(0)
    totals, comps = torch.randn(3, 5, generator=g), {"loud": torch.randn(3, 5, generator=g) * 100,
                                                      "quiet": torch.randn(3, 5, generator=g)}  # fmt: skip
    comps["quiet"][1] = 0.25  # a group where a reward does not vary: it adds nothing there
    wr = WeightedReward([("loud", 1.0, loud), ("quiet", 2.0, quiet)])
    assert torch.equal(wr.group_value(totals, comps), totals)  # "sum": the weighted sum itself
    wr.combine = "group_normalized"
    z = {k: (v - v.mean(1, keepdim=True)) / (v.std(1, unbiased=False, keepdim=True) + 1e-6) for k, v in comps.items()}
    torch.testing.assert_close(wr.group_value(totals, comps), z["loud"] + 2 * z["quiet"])
    torch.testing.assert_close(wr.group_value(totals, comps)[1], z["loud"][1])

    pipe = _stock("sd3", pipes["sd3"])
    ex = Explorer(pipe, wr, n=6, k=2, preview_steps=2, explore_precision="nvfp4", resolution=SIZES["sd3"])
    sel = ex.select(PROMPTS, [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]])
    want = wr.group_value(ex.last_totals, ex.last_components)
    assert torch.equal(sel.all_rewards, want)  # ranked by the normalised combination
    assert torch.equal(sel.index.sort(1).values, select_contrastive(want, 2).sort(1).values)
    torch.testing.assert_close(ex.last_totals, ex.last_components["loud"] + 2 * ex.last_components["quiet"])
