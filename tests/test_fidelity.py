"""`solrl fidelity`: the 4-bit FLOP share, the oracle cache and the layer search, on the bundled model."""

import fnmatch
import json

import pytest
import torch
from torch import nn

from solrl_engine.cli import main
from solrl_engine.nn import quantize_model
from solrl_engine.nn.flops import count_linear_flops, group_name
from solrl_engine.quant import QuantRecipe
from solrl_engine.rl import load_config
from solrl_engine.rl.fidelity import candidate_groups, fidelity, search
from solrl_engine.rl.runtime import explorer_for

TINY = "configs/tiny.py:tiny_sol_rl_shapes"
FAST = ["full_steps=2", "preview_steps=1", "explore_precision=nvfp4"]  # auto on a CPU may explore with the policy


def test_linear_flops_count_rows_per_layer_and_format():
    torch.manual_seed(0)
    lin, hi = nn.Linear(32, 64), nn.Linear(64, 48)
    conv = nn.Conv2d(48, 16, 1)
    q = nn.ModuleDict({"lin": lin, "hi": hi, "conv": conv})
    quantize_model(q, QuantRecipe(include=("lin",)))

    def run() -> None:
        h = q["hi"](q["lin"](torch.randn(3, 5, 32)))  # 15 rows
        q["conv"](h.reshape(3, 5, 1, 48).permute(0, 3, 1, 2))  # 3 x 5 x 1 pixels = 15 rows

    f = count_linear_flops(q, run)
    assert f.layers == {"lin": 2 * 15 * 32 * 64, "hi": 2 * 15 * 64 * 48, "conv": 2 * 15 * 48 * 16}
    assert f.formats == {"lin": "nvfp4", "hi": "high", "conv": "high"}
    assert f.share("nvfp4") == pytest.approx(32 * 64 / (32 * 64 + 64 * 48 + 48 * 16))


def test_group_names_keep_inner_indices_apart():
    assert group_name("transformer_blocks.3.ff.net.0.proj") == "transformer_blocks.*.ff.net.0.proj"
    assert group_name("transformer_blocks.11.ff.net.2") == "transformer_blocks.*.ff.net.2"
    assert not fnmatch.fnmatchcase("transformer_blocks.1.ff.net.0.proj", group_name("transformer_blocks.1.ff.net.2"))
    assert group_name("proj_out") == "proj_out"


@pytest.fixture(scope="module")
def tiny_ex():
    return explorer_for(load_config(TINY, FAST))


def test_flop_share_counts_image_and_text_tokens(tiny_ex):
    """The image-stream MLP runs over the image tokens, the context MLP over the text tokens: the
    counted FLOPs are 2 x tokens x in x out for each."""
    ro = tiny_ex.rollouts
    f = ro.linear_flops(tiny_ex.copy.transformer)
    t = ro.model.transformer
    c, h, w = ro.model.latent_shape
    p = t.config.patch_size
    img_tokens = (h // p) * (w // p)
    txt_tokens = ro.encode(["a"]).hidden.shape[1]
    ff = t.transformer_blocks[0].ff.net[0].proj
    ffc = t.transformer_blocks[0].ff_context.net[0].proj
    assert f.layers["transformer_blocks.0.ff.net.0.proj"] == 2 * img_tokens * ff.in_features * ff.out_features
    assert f.layers["transformer_blocks.0.ff_context.net.0.proj"] == 2 * txt_tokens * ffc.in_features * ffc.out_features
    # the default rule quantizes the image-stream MLPs only: about half the linear FLOPs (the figure)
    share = f.share("nvfp4")
    mlp = sum(v for k, v in f.layers.items() if fnmatch.fnmatchcase(k, "transformer_blocks.*.ff.*"))
    assert share == pytest.approx(mlp / f.total) and 0.4 < share < 0.7


def test_oracle_cache_is_reused_and_never_mixed(tmp_path):
    cache = tmp_path / "oracle.json"
    cfg = load_config(TINY, FAST)
    a = fidelity(cfg, prompts=2, n=6, k=2, progress=False, oracle_cache=cache)
    b = fidelity(cfg, prompts=2, n=6, k=2, progress=False, oracle_cache=cache)
    assert a["time_full_s"] > 0 and b["time_full_s"] == 0 and b["oracle_cached"]
    assert b["full_reward_mean"] == pytest.approx(a["full_reward_mean"], abs=1e-6)
    assert b["spearman_mean"] == pytest.approx(a["spearman_mean"])
    key = json.loads(cache.read_text())["key"]
    c = fidelity(load_config(TINY, ["full_steps=3", "preview_steps=1"]), prompts=2, n=6, k=2, progress=False,
                 oracle_cache=cache)  # fmt: skip
    assert c["time_full_s"] > 0 and json.loads(cache.read_text())["key"] != key  # other settings: rebuilt


def test_search_orders_groups_and_keeps_the_target(tmp_path):
    cfg = load_config(TINY, FAST)
    ex = explorer_for(cfg)
    ro = ex.rollouts
    groups = candidate_groups(ro, ex.copy)
    names = [n for n, m in ro.model.transformer.named_modules() if isinstance(m, nn.Linear)]
    for g in groups:  # every pattern names its own layers and nothing else
        assert {n for n in names if fnmatch.fnmatchcase(n, g)} == {n for n in names if group_name(n) == g}
    everything = search(cfg, target=-1.0, prompts=2, n=6, k=2, progress=False, probe_prompts=1, probe_seeds=4)
    assert everything["chosen"]["include"] == [g["group"] for g in everything["groups"]]
    assert len(everything["points"]) == 1 and everything["chosen"]["quantized_flop_share"] > 0.9
    res = search(cfg, target=0.5, prompts=3, n=8, k=2, progress=False, probe_prompts=1, probe_seeds=4)
    pts = {p["groups"]: p for p in res["points"]}
    m = len(res["chosen"]["include"])
    if m:
        assert pts[m]["spearman_mean"] >= 0.5
    assert all(p["spearman_mean"] < 0.5 for g, p in pts.items() if g == m + 1)  # the next prefix failed
    order = [g["group"] for g in res["groups"]]
    assert res["chosen"]["include"] == order[:m]
    density = [g["sensitivity"] / g["flop_share"] for g in res["groups"]]
    assert density == sorted(density)  # least damage per FLOP first


def test_search_cli_writes_a_rule_that_loads(tmp_path):
    out = tmp_path / "search.json"
    args = ["fidelity", TINY, "--set", FAST[0], "--set", FAST[1], "--prompts", "2", "--n", "6", "--k", "2",
            "--search", "--target", "-1", "--output", str(out)]  # fmt: skip
    assert main(args) == 0
    res = json.loads(out.read_text())
    snippet = out.with_suffix(".snippet.py").read_text()
    assert res["config_snippet"] in snippet
    sets = [a.strip() for a in res["set_arg"].split("--set") if a.strip()]
    assert sets[0].startswith("explore_precision=")  # the rule is the explore format's: it names it
    cfg = load_config(TINY, FAST + sets)
    quantized = set(explorer_for(cfg).copy.report.quantized)
    assert {group_name(n) for n in quantized} == set(res["chosen"]["include"])


def test_search_with_a_tolerance_judges_against_the_policys_previews_and_says_when_nothing_qualifies(monkeypatch):
    """--tolerance: the policy's own previews are measured first (transformer None) and the target is their
    Spearman minus the tolerance; where no group qualifies the result says the policy's precision explores and
    its --set says so. Here the quantized previews are made useless (noise) so that nothing can qualify."""
    from solrl_engine.rl import fidelity as fid

    real = fid._proxy
    seen: list[bool] = []

    def proxy(st, transformer, progress, desc="previews", tag="explore"):  # noqa: ANN001, ANN202
        seen.append(transformer is None)
        pr, t = real(st, transformer, progress, desc, tag)
        return (pr if transformer is None else torch.randn(pr.shape, generator=torch.Generator().manual_seed(0))), t

    monkeypatch.setattr(fid, "_proxy", proxy)
    cfg = load_config(TINY, FAST + ["explore_precision=int8"])
    res = search(cfg, tolerance=0.005, prompts=2, n=6, k=2, progress=False, probe_prompts=1, probe_seeds=4)
    assert seen[0] is True  # the policy's previews come first
    pol = res["policy_previews"]["spearman_mean"]
    assert res["tolerance"] == 0.005 and abs(res["target_spearman"] - (pol - 0.005)) < 1e-12
    assert res["chosen"]["include"] == [] and res["set_arg"] == "--set explore_precision=bf16"
    assert "the policy's precision explores" in res["verdict"] and res["explore_recipe"] == "int8"
    with pytest.raises(ValueError, match="tolerance"):
        search(cfg, tolerance=-0.1, prompts=2, n=6, k=2, progress=False)


def test_the_finals_come_from_the_objectives_sampler(tmp_path, monkeypatch):
    """Flow-GRPO regenerates with its SDE: fidelity's oracle samples the same way (its window passed to the
    rollouts), so previews are ranked against what the trainer will train on, and its cache never mixes the two."""
    from solrl_engine.sampling.rollouts import Rollouts

    windows: list = []
    couples: list = []
    sample = Rollouts.sample

    def spy(self, cond, seeds, steps, transformer=None, tag="", window=None, trace=None, couple=None):  # noqa: ANN001, ANN202
        windows.append((steps, window))
        couples.append((steps, couple))
        return sample(self, cond, seeds, steps, transformer, tag, window, trace, couple)

    monkeypatch.setattr(Rollouts, "sample", spy)
    cache = tmp_path / "oracle.json"
    ode = fidelity(load_config(TINY, FAST), prompts=2, n=6, k=2, progress=False, oracle_cache=cache)
    assert [w for s, w in windows if s == 2] == [None, None]  # the finals (2 steps): the ODE solver
    windows.clear()
    sde = fidelity(load_config(TINY, [*FAST, "objective=flow_grpo"]), prompts=2, n=6, k=2, progress=False,
                   oracle_cache=cache)  # fmt: skip
    assert [w for s, w in windows if s == 2] == [(0, 1), (0, 1)] and sde["time_full_s"] > 0  # not the ODE's cache
    assert sde["full_reward_mean"] != pytest.approx(ode["full_reward_mean"], abs=1e-6)
    windows.clear()
    couples.clear()
    fidelity(load_config(TINY, ["full_steps=4", "preview_steps=1", "explore_precision=nvfp4",
                                "objective=flow_grpo_fast", "sde_window=1", "preview_sde=False"]), prompts=3, n=6,
             k=2, progress=False)  # fmt: skip
    got = [w for s, w in windows if s == 4]
    assert len(got) == 3 and all(w[1] - w[0] == 1 and 0 <= w[0] <= 1 for w in got)  # 1 step in the first half
    assert all(c is None for _, c in couples)  # preview_sde=False: ODE previews (solver dpm2), nothing coupled
    couples.clear()
    windows.clear()
    coupled = fidelity(load_config(TINY, ["full_steps=4", "preview_steps=2", "explore_precision=nvfp4",
                                          "objective=flow_grpo_fast", "sde_window=1"]),
                       prompts=3, n=6, k=2, progress=False)  # fmt: skip
    # by default (auto): each prompt's previews on the Brownian path of that prompt's regeneration (its window)
    assert [(c.steps, c.window) for s, c in couples if s == 2] == [(4, w) for s, w in windows if s == 4]
    assert coupled["previews_coupled"] is True
