"""Prompt sets in every accepted form: the bundled sets, .txt and .jsonl files, DIR:split, and errors
that name the spec (or the file and line) and what is accepted."""

from __future__ import annotations

import json

import pytest

from solrl_engine.data import load_prompts


def test_bundled_sample_sizes_and_no_overlap():
    train, test = load_prompts("sample/train"), load_prompts("sample/test")
    assert len(train) == 48 and len(test) == 16
    assert len(set(train)) == len(train) and len(set(test)) == len(test)
    assert not {p.lower() for p in train} & {p.lower() for p in test}
    assert all(3 <= len(p.split()) <= 20 for p in train + test)


def test_bundled_shapes_splits_are_unchanged():
    assert len(load_prompts("shapes/train")) == 690 and len(load_prompts("shapes/heldout")) == 64
    with pytest.raises(ValueError, match="unknown prompt set 'shapes/valid'.*shapes/heldout"):
        load_prompts("shapes/valid")
    with pytest.raises(ValueError, match="unknown prompt set 'sample/valid'.*sample/test"):
        load_prompts("sample/valid")


def test_text_files_one_prompt_per_line(tmp_path):
    (tmp_path / "p.txt").write_text("a cat\n\n  a dog  \nun café au lait\n", encoding="utf-8")
    assert load_prompts(str(tmp_path / "p.txt")) == ["a cat", "a dog", "un café au lait"]
    (tmp_path / "list").write_text("one\ntwo\n")  # any suffix but .jsonl reads as lines
    assert load_prompts(str(tmp_path / "list")) == ["one", "two"]
    (tmp_path / "empty.txt").write_text("\n \n")
    with pytest.raises(ValueError, match="empty.txt has no prompts"):
        load_prompts(str(tmp_path / "empty.txt"))


def test_jsonl_files_read_the_prompt_field(tmp_path):
    lines = [json.dumps({"prompt": "a cat", "tag": 1, "meta": {"x": 2}}), "", json.dumps({"prompt": " a dog "})]
    (tmp_path / "p.jsonl").write_text("\n".join(lines) + "\n")
    assert load_prompts(str(tmp_path / "p.jsonl")) == ["a cat", "a dog"]
    (tmp_path / "bad.jsonl").write_text(json.dumps({"prompt": "ok"}) + "\n" + json.dumps({"text": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: .*\"prompt\""):
        load_prompts(str(tmp_path / "bad.jsonl"))
    (tmp_path / "broken.jsonl").write_text('{"prompt": "a"}\n{"prompt": \n')
    with pytest.raises(ValueError, match=r"broken.jsonl:2: not a JSON line"):
        load_prompts(str(tmp_path / "broken.jsonl"))
    (tmp_path / "blank.jsonl").write_text(json.dumps({"prompt": "  "}) + "\n")
    with pytest.raises(ValueError, match=r"blank.jsonl:1: .*empty"):
        load_prompts(str(tmp_path / "blank.jsonl"))


def test_directory_with_a_split(tmp_path):
    d = tmp_path / "pickscore"
    d.mkdir()
    (d / "train.txt").write_text("one\ntwo\n")
    (d / "test.jsonl").write_text(json.dumps({"prompt": "three"}) + "\n")
    assert load_prompts(f"{d}:train") == ["one", "two"]
    assert load_prompts(f"{d}:test") == ["three"]
    with pytest.raises(ValueError, match=r"has no valid.txt or valid.jsonl \(it has: test.jsonl, train.txt\)"):
        load_prompts(f"{d}:valid")
    with pytest.raises(ValueError, match="is a directory: name a split.*:train"):
        load_prompts(str(d))


def test_unknown_specs_name_the_spec_and_what_is_accepted(tmp_path):
    with pytest.raises(ValueError, match="unknown prompt set 'pickscore/train'; accepted: shapes/train.*DIR:SPLIT"):
        load_prompts("pickscore/train")
    with pytest.raises(ValueError, match="prompt file '.*missing.txt' does not exist; accepted"):
        load_prompts(str(tmp_path / "missing.txt"))
    with pytest.raises(ValueError, match="unknown prompt set '.*nowhere:train'; accepted"):
        load_prompts(str(tmp_path / "nowhere") + ":train")


def test_the_geneval_prompt_sets_are_ready_for_a_detector_reward():
    """GenEval-style composition prompts (counting, colours, positions, two objects), each line with GenEval's
    metadata (tag, include: class, count, colour, position); no offline detector scores them yet (docs say so)."""
    import json

    from solrl_engine.data import BUNDLED, load_prompts

    for split, n in (("train", 48), ("test", 16)):
        prompts = load_prompts(f"geneval/{split}")
        lines = [json.loads(x) for x in (BUNDLED / f"geneval_{split}.jsonl").read_text().splitlines()]
        assert len(prompts) == len(lines) == n and prompts == [r["prompt"] for r in lines]
        assert {r["tag"] for r in lines} <= {"counting", "colors", "position", "two_object"}
        assert all(r["include"] and all(o["class"] in r["prompt"] for o in r["include"]) for r in lines)
