"""The paper presets: every <model>_<family>_<reward> function loads through load_config (the user's
path) and validates without weights; prompt sets in every accepted form."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from solrl_engine.data import load_prompts
from solrl_engine.rl import FAMILIES, ConfigError, load_config
from solrl_engine.rl.presets import PAPER, REWARD_NAMES

ROOT = Path(__file__).resolve().parents[1]
FILES = {"sd3": ("sd3.py", "sd3"), "flux": ("flux1.py", "flux1"), "sana": ("sana.py", "sana")}


def test_all_sixty_presets_load_validate_and_carry_the_papers_settings():
    import importlib.util

    seen = []
    for model, (fname, prefix) in FILES.items():
        spec = importlib.util.spec_from_file_location(f"preset_{prefix}", ROOT / "configs" / fname)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        names = sorted(n for n in vars(mod) if n.startswith(prefix + "_"))
        assert names == sorted(f"{prefix}_{f}_{r}" for f in FAMILIES for r in REWARD_NAMES)
        for name in names:
            cfg = load_config(f"{ROOT / 'configs' / fname}:{name}")
            family = name[len(prefix) + 1 :].rsplit("_", 1)[0]
            assert (cfg.model, cfg.family, cfg.reward, cfg.name) == (model, family, name.rsplit("_", 1)[1], name)
            assert (cfg.k, cfg.prompts_per_iter, cfg.preview_steps, cfg.full_steps) == (24, 48, 6, 10)
            assert cfg.n == (24 if family == "diffusionnft" else 96)
            assert (cfg.lora_rank, cfg.lora_alpha) == (32, 64)
            assert cfg.timestep_fraction == PAPER[model]["timestep_fraction"]
            assert cfg.grad_clip == PAPER[model]["grad_clip"]
            seen.append(name)
    assert len(seen) == 60
    assert load_config(f"{ROOT}/configs/flux1.py:flux1_sol_rl_pickscore").timestep_fraction == 0.4
    assert load_config(f"{ROOT}/configs/sd3.py:sd3_sol_rl_pickscore").grad_clip == 0.002


def test_presets_take_overrides_and_unknown_names_list_what_exists():
    cfg = load_config(f"{ROOT}/configs/sana.py:sana_sol_rl_hpsv2", ["n=32", "k=8", "model_path=/w/sana"])
    assert (cfg.n, cfg.k, cfg.model_path) == (32, 8, "/w/sana")
    with pytest.raises(ConfigError, match="sana_sol_rl_hpsv2"):
        load_config(f"{ROOT}/configs/sana.py:sana_sol_rl_nothing")


def test_prompt_sets_in_every_form(tmp_path):
    train, test = load_prompts("sample/train"), load_prompts("sample/test")
    assert len(train) >= 40 and len(test) >= 12 and not set(train) & set(test)
    (tmp_path / "p.txt").write_text("a cat\n\n a dog \n")
    assert load_prompts(str(tmp_path / "p.txt")) == ["a cat", "a dog"]
    lines = [json.dumps({"prompt": "a cat", "tag": 1}), json.dumps({"prompt": "a dog"})]
    (tmp_path / "p.jsonl").write_text("\n".join(lines))
    assert load_prompts(str(tmp_path / "p.jsonl")) == ["a cat", "a dog"]
    d = tmp_path / "pickscore"
    d.mkdir()
    (d / "train.txt").write_text("one\ntwo\n")
    (d / "test.jsonl").write_text(json.dumps({"prompt": "three"}) + "\n")
    assert load_prompts(f"{d}:train") == ["one", "two"] and load_prompts(f"{d}:test") == ["three"]
    with pytest.raises(ValueError, match="no valid.txt"):
        load_prompts(f"{d}:valid")
    (tmp_path / "bad.jsonl").write_text('{"text": "x"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1.*prompt"):
        load_prompts(str(tmp_path / "bad.jsonl"))
    with pytest.raises(ValueError, match="unknown prompt set"):
        load_prompts("pickscore/train")
