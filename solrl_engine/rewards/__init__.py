"""Reward models behind one registry: `load_reward(spec, args)` returns a callable
`(images [B, 3, H, W] float in [0, 1], prompts: list[str]) -> Tensor[B]`.

`spec` is one name or a weighted sum ("pickscore:1.0,clipscore:0.5"); `args` gives each component
its keyword arguments ({"pickscore": {"model": "/w/pickscore"}}), parsed from the config's
`reward_args` strings ("pickscore.model=/w/pickscore") by `parse_reward_args`. The callable keeps
the last call's per-component scores in `last_components`, so the trainer logs every component.

Adding a reward is one new file plus one line in REWARDS. Heavy scorers import their packages lazily
and have a cheap `check_weights(**kwargs)` that `check_reward` runs before any model loads, so a
missing weight file or an offline cache miss fails at start-up with the exact file or id expected.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch

from solrl_engine.models.base import RewardFn  # the name's home is the model interface

# name -> "module:attribute" of a factory (or class) taking the reward's keyword arguments
REWARDS: dict[str, str] = {
    "shapes": "solrl_engine.rewards.shapes:ShapesReward",
    "clipscore": "solrl_engine.rewards.clipscore:CLIPScore",
    "pickscore": "solrl_engine.rewards.pickscore:PickScore",
    "hpsv2": "solrl_engine.rewards.hpsv2:HPSv2",
    "hpsv3": "solrl_engine.rewards.hpsv3:HPSv3",  # a Qwen2-VL preference model, scored on transformers' classes
    "imagereward": "solrl_engine.rewards.imagereward:ImageRewardScorer",
    "temporal": "solrl_engine.rewards.video:TemporalConsistency",  # videos only: consecutive frames agreeing
    "ocr": "solrl_engine.rewards.ocr:OCRReward",  # text rendering (Flow-GRPO's task): prompts quote the text
    "vlm": "solrl_engine.rewards.vlm:VLMJudge",  # a VLM judge on an OpenAI-compatible server (vLLM, SGLang)
    "preserve": "solrl_engine.rewards.edit:Preservation",  # editing: how much of the source image an edit keeps
    "clip_direction": "solrl_engine.rewards.clip_direction:CLIPDirection",  # editing: the edit's CLIP direction
}


def parse_reward_spec(spec: str) -> list[tuple[str, float]]:
    """ "pickscore:1.0,clipscore:0.5" -> [("pickscore", 1.0), ("clipscore", 0.5)]; a bare name has weight 1."""
    out: list[tuple[str, float]] = []
    for part in spec.split(","):
        name, _, w = part.strip().partition(":")
        name = name.strip()
        if name not in REWARDS:
            raise ValueError(f"unknown reward {name!r} in {spec!r}; available: {sorted(REWARDS)}")
        try:
            weight = float(w) if w.strip() else 1.0
        except ValueError:
            raise ValueError(f"reward {spec!r}: weight {w!r} of {name} is not a number (write name:weight)") from None
        if not math.isfinite(weight):
            raise ValueError(f"reward {spec!r}: weight {w.strip()!r} of {name} is not a finite number: every update "
                             "would be skipped (write name:weight with a number, e.g. shapes:1.0)")  # fmt: skip
        out.append((name, weight))
    if len({n for n, _ in out}) != len(out):
        raise ValueError(f"reward {spec!r} names a reward twice")
    if all(w == 0 for _, w in out):
        raise ValueError(f"reward {spec!r}: every weight is 0, so every sample scores the same and nothing is "
                         "learned; give at least one reward a non-zero weight (negative weights are penalties)")
    return out


def parse_reward_args(items: tuple[str, ...] | list[str]) -> dict[str, dict[str, str]]:
    """("pickscore.model=/w/ps", "hpsv2.checkpoint=/w/hps.pt") -> {"pickscore": {"model": ...}, ...}."""
    out: dict[str, dict[str, str]] = {}
    for item in items:
        key, eq, value = item.partition("=")
        name, dot, arg = key.strip().partition(".")
        if not eq or not dot or not name or not arg.strip() or not value.strip():
            raise ValueError(f"reward_args item {item!r}: write name.key=value, e.g. pickscore.model=/w/pickscore")
        if name not in REWARDS:
            raise ValueError(f"reward_args item {item!r}: unknown reward {name!r}; available: {sorted(REWARDS)}")
        out.setdefault(name, {})[arg.strip()] = value.strip()
    return out


def _module(name: str) -> Any:
    mod, _ = REWARDS[name].split(":")
    with _needs_packages(name):
        return importlib.import_module(mod)


@contextlib.contextmanager
def _needs_packages(name: str) -> Iterator[None]:
    """A missing package (imported lazily by a reward) names the extra that installs it."""
    try:
        yield
    except ModuleNotFoundError as e:
        raise ImportError(f'reward {name!r} needs the package {e.name!r}: pip install -e ".[rewards]"') from e


def _factory(name: str) -> Callable[..., RewardFn]:
    return getattr(_module(name), REWARDS[name].split(":")[1])


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
# how several rewards are combined for ranking and training (WeightedReward.group_value); the config's reward_combine
COMBINE = ("sum", "group_normalized")


def _reward_kwargs(name: str, kw: dict[str, Any]) -> dict[str, Any]:
    """Check `kw` against the reward's constructor (a misspelt key fails at start-up, listing the valid
    ones) and convert the strings reward_args gives: to the type of the parameter's default (bool, int,
    float), and dtype names ("bfloat16") to torch dtypes."""
    sig = inspect.signature(_factory(name))
    params = sig.parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        valid = [k for k, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        for key in kw:
            if key not in valid:
                known = ", ".join(valid) or "(none)"
                raise ValueError(f"reward {name!r} has no argument {key!r}; its arguments: {known}")
    out = dict(kw)
    for key, value in kw.items():
        if not isinstance(value, str):
            continue
        default = params[key].default if key in params else None
        try:
            if key == "dtype":
                dt = getattr(torch, value.removeprefix("torch."), None)
                if not isinstance(dt, torch.dtype):
                    raise ValueError
                out[key] = dt
            elif isinstance(default, bool):
                if value.lower() not in _TRUE + _FALSE:
                    raise ValueError
                out[key] = value.lower() in _TRUE
            elif isinstance(default, int | float):
                out[key] = type(default)(value)
        except ValueError:
            want = "a torch dtype (float32, bfloat16, ...)" if key == "dtype" else type(default).__name__
            raise ValueError(f"reward argument {name}.{key}={value!r}: expected {want}") from None
    return out


def check_reward(spec: str, args: dict[str, dict[str, str]] | None = None, urls: dict[str, str] | None = None,
                 wait_s: float = 600.0) -> None:  # fmt: skip
    """Validate the spec, every component's arguments, and that its weights can be found (each reward
    module's cheap `check_weights`), before any model loads; a reward scored remotely (`urls`: name -> server,
    the config's reward_url) is checked by its server's handshake instead (it hosts the reward, with these args)."""
    args, urls = args or {}, urls or {}
    names = [n for n, _ in parse_reward_spec(spec)]
    for extra in sorted(set(args) - set(names)):
        raise ValueError(f"reward_args names {extra!r}, which is not part of reward {spec!r}")
    for extra in sorted(set(urls) - set(names)):
        raise ValueError(f"reward_url names {extra!r}, which is not part of reward {spec!r}")
    for name in names:
        if name in urls:
            from solrl_engine.rewards.remote import RemoteReward

            RemoteReward(name, urls[name], wait_s, expect=args.get(name, {}))
            continue
        kw = _reward_kwargs(name, args.get(name, {}))
        check = getattr(_module(name), "check_weights", None)
        if check is None:
            continue
        params = inspect.signature(check).parameters
        if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            kw = {k: v for k, v in kw.items() if k in params}
        with _needs_packages(name):
            check(**kw)


class WeightedReward:
    """sum_i w_i * reward_i(images, prompts); `last_components` holds each reward's last scores.

    Videos [B, T, 3, H, W]: each image reward scores `frames` frames spread over every clip, aggregated by
    `frame_agg` ("mean" or "min"; rewards/video.py); a video reward (`temporal`) gets the clips whole."""

    def __init__(self, parts: list[tuple[str, float, RewardFn]], frames: int = 4, frame_agg: str = "mean",
                 combine: str = "sum") -> None:  # fmt: skip
        self.parts = parts
        self.frames, self.frame_agg = frames, frame_agg
        self.combine = combine  # how a prompt group's rewards are combined (COMBINE); `group_value` applies it
        self.last_components: dict[str, torch.Tensor] = {}

    def group_value(self, totals: torch.Tensor, components: dict[str, torch.Tensor]) -> torch.Tensor:
        """What ranks and trains a prompt group's samples: rows are prompt groups ([P, G]). With combine="sum", the
        weighted sum itself (`totals`); with "group_normalized", each reward normalised within its group (minus the
        group's mean, over its std), then weighted: a reward of large spread cannot drown the others. A group whose
        reward does not vary contributes 0 for it."""
        if self.combine == "sum" or len(self.parts) == 1:
            return totals
        out = torch.zeros_like(totals, dtype=torch.float32)
        for name, w, _ in self.parts:
            r = components[name].float().to(out.device).view_as(out)
            z = (r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, unbiased=False, keepdim=True) + 1e-6)
            out = out + w * z
        return out

    def __call__(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        from solrl_engine.rewards.video import score_frames

        total = None
        comps = {}
        video = images.dim() == 5
        for name, w, fn in self.parts:
            if video and not getattr(fn, "video", False):
                r = score_frames(fn, images, prompts, self.frames, self.frame_agg)
            else:
                r = fn(images, prompts)
            if not isinstance(r, torch.Tensor) or r.shape != (len(prompts),):
                shape = tuple(r.shape) if isinstance(r, torch.Tensor) else type(r).__name__
                raise TypeError(f"reward {name!r} returned {shape}; expected a Tensor[{len(prompts)}]")
            comps[name] = r.detach().float()
            total = w * r.float() if total is None else total + w * r.float().to(total.device)
        self.last_components = comps
        assert total is not None
        return total

    def check_prompts(self, prompts: list[str]) -> None:
        """Each reward that can reject a prompt (a `check_prompts` of its own: the shapes grammar) checks
        all of them before a run writes anything, so a bad line is not met hours in."""
        for _name, _w, fn in self.parts:
            if (check := getattr(fn, "check_prompts", None)) is not None:
                check(list(prompts))

    def __repr__(self) -> str:
        return " + ".join(f"{w:g} * {n}" for n, w, _ in self.parts)


def load_reward(spec: str, args: dict[str, dict[str, str]] | None = None, urls: dict[str, str] | None = None,
                wait_s: float = 600.0, **kwargs: object) -> WeightedReward:  # fmt: skip
    """Build the reward `spec` (a name from REWARDS or a weighted sum). `args` are per-reward keyword
    arguments; plain `kwargs` go to a single named reward (load_reward("shapes")). Rewards named in `urls` (the
    config's reward_url) are scored by their servers (rewards.remote.RemoteReward, waiting up to `wait_s` for one
    that is unreachable); the others in this process."""
    parts = parse_reward_spec(spec)
    args, urls = args or {}, urls or {}
    if kwargs and len(parts) != 1:
        raise ValueError("keyword arguments apply to a single reward; use args={name: {...}} for a sum")
    built = []
    for name, w in parts:
        if name in urls:
            from solrl_engine.rewards.remote import RemoteReward

            built.append((name, w, RemoteReward(name, urls[name], wait_s, expect=args.get(name, {}))))
            continue
        kw = _reward_kwargs(name, {**args.get(name, {}), **kwargs})
        with _needs_packages(name):
            built.append((name, w, _factory(name)(**kw)))
    return WeightedReward(built)


__all__ = [
    "COMBINE",
    "REWARDS",
    "RewardFn",
    "WeightedReward",
    "check_reward",
    "load_reward",
    "parse_reward_args",
    "parse_reward_spec",
]
