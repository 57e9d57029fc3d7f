"""Conditioned prompt sets (an instruction and its image per JSON line), the bundled editing set, and the editing
rewards that read each prompt's source: loaded and validated with the file and line of what is wrong, equal only
with the same images, pickled whole; `preserve` and `clip_direction` against their definitions on fresh images."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from solrl_engine.data import ConditionedPrompt, check_conditioning, load_prompts, prompt_images
from solrl_engine.data.edit import SPLITS, edits, render_source, write_edit_set


def _png(path: Path, size: tuple[int, int] = (40, 24), mode: str = "RGB", seed: int = 0) -> Path:
    g = np.random.default_rng(seed)
    if mode == "I;16":
        Image.fromarray(g.integers(0, 65535, size[::-1], dtype=np.uint16)).save(path)
    else:
        Image.fromarray(g.integers(0, 255, (*size[::-1], 3), dtype=np.uint8)).convert(mode).save(path)
    return path


def _jsonl(path: Path, lines: list[object]) -> Path:
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return path


def test_a_conditioned_set_loads_with_paths_relative_to_its_file(tmp_path):
    (tmp_path / "img").mkdir()
    _png(tmp_path / "img" / "a.png")
    _png(tmp_path / "img" / "b.png", mode="P", seed=1)
    lines = [{"prompt": " make it red ", "image": "img/a.png"}, "",
             {"prompt": "two views", "images": ["img/a.png", "img/b.png"], "x": 1}]
    f = _jsonl(tmp_path / "set.jsonl", lines)
    got = load_prompts(str(f))
    a, b = tmp_path / "img" / "a.png", tmp_path / "img" / "b.png"
    assert got == [ConditionedPrompt("make it red", [a]), ConditionedPrompt("two views", [a, b])]
    assert [str(p) for p in got] == ["make it red", "two views"] and prompt_images("plain") == ()
    assert [im.mode for im in got[1].open_images()] == ["RGB", "RGB"]  # a palette image converts
    assert load_prompts(f"{tmp_path}:set") == got  # the DIR:SPLIT layout too


def test_prompts_are_equal_only_with_the_same_images_and_pickle_whole(tmp_path):
    a, b = _png(tmp_path / "a.png"), _png(tmp_path / "b.png", seed=1)
    pa, pb = ConditionedPrompt("edit", [a]), ConditionedPrompt("edit", [b])
    assert pa != pb and pa != "edit" and "edit" != pa and pa == ConditionedPrompt("edit", [a])
    assert len({pa, pb, "edit"}) == 3 and {pa: 1}.get(ConditionedPrompt("edit", [a])) == 1
    back = pickle.loads(pickle.dumps(pa))
    assert back == pa and back.images == (a,) and isinstance(back, ConditionedPrompt)
    assert json.dumps([pa]) == '["edit"]'  # logs and metrics see the text


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ({"prompt": "x", "image": "missing.png"}, r"set.jsonl:2: image .*missing.png does not exist"),
        ({"prompt": "x", "image": "bad.png"}, r"set.jsonl:2: image .*bad.png cannot be read as an image"),
        ({"prompt": "x", "image": "deep.png"}, r"set.jsonl:2: image .*deep.png has mode 'I;16'.*8-bit RGB"),
        ({"prompt": "x", "image": "tiny.png"}, r"set.jsonl:2: image .*tiny.png is 8 x 8: use sides between 16"),
        ({"prompt": "x", "image": "ok.png", "images": ["ok.png"]}, r'set.jsonl:2: give "image" or "images"'),
        ({"prompt": "x", "images": []}, r'set.jsonl:2: "images" is empty'),
        ({"prompt": "x", "image": 3}, r'set.jsonl:2: "image" is a path'),
        ({"prompt": "x"}, r"set.jsonl:2: line 1 is conditioned on an image and line 2 is not"),
    ],
)
def test_a_bad_line_is_refused_with_its_file_and_line(tmp_path, line, match):
    _png(tmp_path / "ok.png")
    _png(tmp_path / "deep.png", mode="I;16")
    _png(tmp_path / "tiny.png", size=(8, 8))
    (tmp_path / "bad.png").write_bytes(b"not a png at all")
    f = _jsonl(tmp_path / "set.jsonl", [{"prompt": "first", "image": "ok.png"}, line])
    with pytest.raises(ValueError, match=match):
        load_prompts(str(f))


def test_a_set_with_images_after_plain_lines_is_refused_too(tmp_path):
    _png(tmp_path / "ok.png")
    f = _jsonl(tmp_path / "set.jsonl", [{"prompt": "plain"}, {"prompt": "x", "image": "ok.png"}])
    with pytest.raises(ValueError, match="set.jsonl:2: line 2 is conditioned on an image and line 1 is not"):
        load_prompts(str(f))


def test_check_conditioning_names_the_key_the_set_and_the_fix():
    edit = load_prompts("edit/test")
    check_conditioning(edit, True, "flux_kontext", "train_prompts", "edit/test")
    check_conditioning(["a cat"], False, "flux", "train_prompts", "sample/train")
    with pytest.raises(ValueError, match="train_prompts='sample/train': model=flux_kontext takes an image.*JSON lines"):
        check_conditioning(["a cat"], True, "flux_kontext", "train_prompts", "sample/train")
    with pytest.raises(ValueError, match="eval_prompts='edit/test': its prompts carry images, which model=flux does "
                                         r"not.*\(flux_kontext, qwenimage_edit\)"):  # fmt: skip
        check_conditioning(edit, False, "flux", "eval_prompts", "edit/test", ("flux_kontext", "qwenimage_edit"))


def test_the_trainer_names_every_family_that_takes_images():
    """The families a text-to-image run given an editing set is pointed to come from the registry."""
    from solrl_engine.models import MODELS, model_spec
    from solrl_engine.rl import ConfigError, load_config
    from solrl_engine.rl.trainer import Trainer

    takers = [n for n in MODELS if model_spec(n).conditioned]
    assert {"flux_kontext", "qwenimage_edit", "wan_i2v"} <= set(takers)
    root = Path(__file__).resolve().parents[1]
    cfg = load_config(f"{root}/configs/tiny.py:tiny_sol_rl_shapes", ["eval_prompts=edit/test"])
    with pytest.raises(ConfigError, match=rf"pick a model that takes them \({', '.join(takers)}\)"):
        Trainer(cfg, progress=False)


def test_rows_of_different_text_lengths_concatenate_padded_and_guide_against_their_own_negatives():
    """Conditioning.cat pads masked text states (and per-row negatives) to the longest row; `against` takes a row's
    own negative where it carries one (Qwen-Image-Edit), else the shared unconditional row; masks stay integer."""
    from solrl_engine.models.base import Conditioning

    g = torch.Generator().manual_seed(0)

    def row(n: int, m: int) -> Conditioning:
        return Conditioning(torch.randn(1, n, 4, generator=g), None, torch.ones(1, n, dtype=torch.long),
                            torch.randn(1, 2, 2, 2, generator=g), None, torch.randn(1, m, 4, generator=g),
                            torch.ones(1, m, dtype=torch.long))  # fmt: skip

    a, b = row(3, 2), row(5, 4)
    c = Conditioning.cat([a, b])
    assert c.hidden.shape == (2, 5, 4) and c.mask.tolist() == [[1, 1, 1, 0, 0], [1] * 5]
    assert torch.equal(c.hidden[0, :3], a.hidden[0]) and not c.hidden[0, 3:].any()
    assert c.negative_hidden.shape == (2, 4, 4) and c.negative_mask.tolist() == [[1, 1, 0, 0], [1] * 4]
    assert torch.equal(c.negative_hidden[1], b.negative_hidden[0])
    shared = Conditioning(torch.zeros(1, 1, 4))
    u = shared.against(c)
    assert u.hidden is c.negative_hidden and u.mask is c.negative_mask and u.image is c.image
    plain = Conditioning(c.hidden, None, c.mask, c.image)
    assert torch.equal(shared.against(plain).hidden, torch.zeros(2, 1, 4))
    moved = c.to(torch.float64)
    assert moved.hidden.dtype == moved.negative_hidden.dtype == torch.float64
    assert moved.mask.dtype == moved.negative_mask.dtype == torch.long


def test_the_bundled_editing_set_is_what_its_generator_draws(tmp_path):
    """The shipped JSONL and PNGs equal a fresh write_edit_set (pixels, not bytes: PNG encoders differ; within one
    level on 1% of the pixels: Pillow 13 rounds an ellipse's edge otherwise than the Pillow 12 that drew them)."""
    write_edit_set(tmp_path)
    for split, n in SPLITS.items():
        shipped, fresh = load_prompts(f"edit/{split}"), load_prompts(str(tmp_path / f"edit_{split}.jsonl"))
        assert len(shipped) == n and [str(p) for p in shipped] == [str(p) for p in fresh]
        for a, b in zip(shipped, fresh, strict=True):
            diff = np.abs(np.asarray(a.open_images()[0]).astype(int) - np.asarray(b.open_images()[0]).astype(int))
            assert diff.max() <= 1 and (diff.max(-1) > 0).mean() <= 0.01, str(a)
        motions, fresh_motions = load_prompts(f"i2v/{split}"), load_prompts(str(tmp_path / f"i2v_{split}.jsonl"))
        assert [str(p) for p in motions] == [str(p) for p in fresh_motions] and len(motions) == n
        assert [p.images for p in motions] == [p.images for p in shipped]  # the editing sources as first frames
    source, instruction, seed = edits("train")[0]
    assert np.asarray(render_source(source, seed)).shape == (128, 128, 3) and instruction.startswith("make the")


def test_preserve_is_one_minus_the_mean_absolute_difference_to_the_resized_source(tmp_path):
    from solrl_engine.rewards import load_reward

    src = _png(tmp_path / "s.png", size=(48, 32))
    prompt = ConditionedPrompt("keep it", [src])
    reward = load_reward("preserve")
    rgb = torch.from_numpy(np.asarray(Image.open(src).convert("RGB")).copy()).permute(2, 0, 1).float() / 255
    same = torch.nn.functional.interpolate(rgb[None], size=(32, 32), mode="bilinear", antialias=True).clamp(0, 1)
    g = torch.Generator().manual_seed(0)
    other = torch.rand(2, 3, 32, 32, generator=g)
    got = reward(torch.cat([same, other]), [prompt] * 3)
    assert torch.allclose(got[0], torch.tensor(1.0), atol=1e-6)
    assert torch.allclose(got[1:], 1 - (other - same).abs().mean(dim=(1, 2, 3)), atol=1e-6) and (got[1:] < 0.9).all()
    nan = other[:1].clone()
    nan[0, 0, 0, 0] = float("nan")
    assert torch.isnan(reward(nan, [prompt]))[0]
    with pytest.raises(ValueError, match="preserve compares an edit with its source image.*has none"):
        reward(other[:1], ["a plain prompt"])
    clips = torch.stack([torch.stack([same[0], other[0]]), torch.stack([other[1], same[0]])])  # [2, T=2, 3, H, W]
    on_clips = reward(clips, [prompt] * 2)  # the first frame against the image the clip starts from
    assert torch.allclose(on_clips, torch.stack([got[0], got[2]]), atol=1e-6)


def rgb_of(path: Path) -> torch.Tensor:
    return torch.from_numpy(np.asarray(Image.open(path).convert("RGB")).copy()).permute(2, 0, 1)[None].float() / 255


def test_clip_direction_is_the_cosine_of_the_image_and_text_moves(tmp_path):
    """cos(E_img(edit) - E_img(source), E_txt(instruction) - E_txt("")) with a tiny CLIP of the real classes:
    equal to the definition computed here, 0 for an unchanged copy."""
    from tiny_clip import build_clip_reward

    from solrl_engine.rewards import load_reward

    clip = build_clip_reward(tmp_path / "clip")
    src = _png(tmp_path / "s.png", size=(32, 32))
    prompt = ConditionedPrompt("make it red", [src])
    from solrl_engine.rewards.clip_direction import CLIPDirection

    reward = CLIPDirection(model=str(clip), device="cpu")
    registered = load_reward("clip_direction", {"clip_direction": {"model": str(clip)}})
    assert torch.allclose(registered(rgb_of(src), [prompt]), reward(rgb_of(src), [prompt]))  # the registry's
    rgb = torch.from_numpy(np.asarray(Image.open(src).convert("RGB")).copy()).permute(2, 0, 1).float() / 255
    g = torch.Generator().manual_seed(1)
    edit = torch.rand(1, 3, 32, 32, generator=g)
    got = reward(torch.cat([edit, rgb[None]]), [prompt, prompt])
    with torch.no_grad():
        t = reward.text_embeds(["make it red", ""])
        d_img = reward.image_embeds(edit) - reward.image_embeds(rgb[None])
        want = torch.nn.functional.cosine_similarity(d_img, t[:1] - t[1:], dim=-1)
    assert torch.allclose(got[0], want[0], atol=1e-5) and got[0] != 0
    assert abs(float(got[1])) < 1e-6  # the source itself: no move


def test_compare_png_shows_each_edit_beside_its_source():
    """compare.png of an editing run: source | base | trained per prompt, the source tile the source image itself
    (resized to the edits' size, then to the tile: nearest, as the edits are); a text-to-image comparison keeps
    its pairs."""
    from solrl_engine.evaluation import Comparison, EvalResult, compare_figure, source_images

    prompts = load_prompts("edit/test")[:2]
    g = torch.Generator().manual_seed(0)
    base, trained = torch.rand(2, 3, 32, 32, generator=g), torch.rand(2, 3, 32, 32, generator=g)
    r = torch.tensor([0.1, 0.2])
    cmp = Comparison(EvalResult(prompts, [0, 0], base, r), EvalResult(prompts, [0, 0], trained, r + 0.1))
    fig = np.asarray(compare_figure(cmp, max_pairs=2))
    plain = Comparison(EvalResult([str(p) for p in prompts], [0, 0], base, r),
                       EvalResult([str(p) for p in prompts], [0, 0], trained, r + 0.1))  # fmt: skip
    pair = np.asarray(compare_figure(plain, max_pairs=2))
    tile, pad, gap = 192, 4, 14  # pair_grid's layout at 32 px: 6x nearest
    assert fig.shape[1] - pair.shape[1] == 2 * (tile + pad)  # one more tile per group, two groups in the row
    src = source_images(prompts[:1], (32, 32))
    want = (src[0].permute(1, 2, 0).numpy() * 255).round().astype(np.uint8).repeat(6, 0).repeat(6, 1)
    assert np.array_equal(fig[20 : 20 + tile, gap : gap + tile], want)  # below the 20 px label row
    assert source_images(["a cat"], (32, 32)) is None
