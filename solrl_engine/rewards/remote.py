"""Rewards scored by a server (`solrl reward-serve`): the wire format both sides share, and the client.

Why: the peers of this engine serve rewards from other processes or GPUs (a reward model beside the trainer's
own), and Sol-RL scores every preview, four times as many images as it trains on. A remote reward is a RewardFn
like any other: `reward_url` maps reward names to servers and the reward grammar stays `name:weight,...`.

The wire format is lossless and compact, so a remote score equals the in-process one: a request is a 4-byte
little-endian header length, a JSON header (protocol, reward, prompts, the images' shape and dtype) and the images'
raw bytes (FP32 or FP16, as the trainer holds them; never PNG, never JSON lists of floats); the answer is JSON
scores (a float32 written by JSON reads back exactly). With SOLRL_REWARD_TOKEN set, every request carries it as a
bearer token and the server refuses one without it.

The client never records a made-up score: a refused request (a wrong token, another reward, an oversized batch)
raises at once with the server's reason; a server that cannot be reached is retried with backoff for up to
`wait_s` (the config's `reward_wait_s`), then the run stops with `RewardServerLost` naming the URL and the last
error, and `--resume` continues from its last checkpoint.
"""

from __future__ import annotations

import json
import logging
import math
import os
import struct
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

import torch

log = logging.getLogger("solrl_engine.rewards")

PROTOCOL = 1
TOKEN_ENV = "SOLRL_REWARD_TOKEN"
WIRE_DTYPES = {"float32": torch.float32, "float16": torch.float16}
MAX_REQUEST_BYTES = 256 * 2**20  # the server's default limit on one request


class RewardServerLost(RuntimeError):
    """The reward server stayed unreachable for `reward_wait_s`: the run stops; `--resume` continues it."""


class RewardRefused(ValueError):
    """The server answered with an error about the request itself (a token, a reward it does not host, a size)."""


def parse_reward_urls(text: str) -> dict[str, str]:
    """ "pickscore=http://127.0.0.1:8000,hpsv2=http://h:8001" -> {name: url}: each a http(s) URL with a host and
    a port, each name once."""
    out: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, eq, url = part.partition("=")
        name, url = name.strip(), url.strip()
        u = urllib.parse.urlsplit(url)
        if not eq or not name or u.scheme not in ("http", "https") or not u.hostname or u.port is None:
            raise ValueError(f"reward_url item {part!r}: write name=http://host:port, e.g. "
                             "pickscore=http://127.0.0.1:8000 (several: a=URL1,b=URL2)")  # fmt: skip
        if name in out:
            raise ValueError(f"reward_url names {name!r} twice")
        out[name] = url.rstrip("/")
    return out


def encode_request(reward: str, images: torch.Tensor, prompts: list[str]) -> bytes:
    """The request body: header length, JSON header, the images' raw bytes (FP32 or FP16, as they are)."""
    name = str(images.dtype).removeprefix("torch.")
    if name not in WIRE_DTYPES:
        images, name = images.float(), "float32"  # BF16 widens exactly
    data = images.detach().contiguous().cpu()
    head = json.dumps({"protocol": PROTOCOL, "reward": reward, "prompts": list(prompts), "shape": list(data.shape),
                       "dtype": name}).encode()  # fmt: skip
    return struct.pack("<I", len(head)) + head + data.numpy().tobytes()


def decode_request(body: bytes) -> tuple[dict[str, Any], torch.Tensor]:
    """(header, images) of a request body; ValueError naming what is wrong with it."""
    if len(body) < 4:
        raise ValueError("the request is shorter than its header length")
    (n,) = struct.unpack("<I", body[:4])
    try:
        head = json.loads(body[4 : 4 + n])
    except ValueError as e:
        raise ValueError(f"the request's header is not JSON ({e})") from None
    if not isinstance(head, dict) or head.get("protocol") != PROTOCOL:
        raise ValueError(f"protocol {head.get('protocol') if isinstance(head, dict) else None!r}: this server speaks "
                         f"{PROTOCOL}; use a client and server of the same solrl-engine release")  # fmt: skip
    shape, dtype, prompts = head.get("shape"), WIRE_DTYPES.get(head.get("dtype", "")), head.get("prompts")
    if not isinstance(shape, list) or len(shape) not in (4, 5) or not all(isinstance(d, int) and d > 0 for d in shape):
        raise ValueError(f"images of shape {shape!r}: send [B, 3, H, W] images or [B, T, 3, H, W] clips")
    if dtype is None:
        raise ValueError(f"images of dtype {head.get('dtype')!r}: send float32 or float16")
    if not isinstance(prompts, list) or len(prompts) != shape[0] or not all(isinstance(p, str) for p in prompts):
        raise ValueError(f"{shape[0]} images need {shape[0]} prompts (strings); got {prompts!r:.200}")
    raw = body[4 + n :]
    want = math.prod(shape) * torch.tensor([], dtype=dtype).element_size()
    if len(raw) != want:
        raise ValueError(f"images of shape {shape} in {head['dtype']} are {want} bytes; the request holds {len(raw)}")
    images = torch.frombuffer(bytearray(raw), dtype=dtype).reshape(shape)
    return head, images


def check_scores(scores: object, n: int, where: str) -> torch.Tensor:
    """Scores as a float32 Tensor[n], or ValueError naming `where`: never a made-up, short or NaN score."""
    if not isinstance(scores, list) or len(scores) != n or not all(isinstance(s, int | float) for s in scores):
        raise ValueError(f"{where} returned {str(scores)[:200]} for {n} images: expected {n} numbers; nothing recorded")
    t = torch.tensor(scores, dtype=torch.float32)
    if not torch.isfinite(t).all():
        raise ValueError(f"{where} returned a non-finite score ({str(scores)[:200]}); nothing recorded")
    return t


def _headers(token: str | None, content_type: str | None = None) -> dict[str, str]:
    h = {"Authorization": f"Bearer {token}"} if token else {}
    return {**h, **({"Content-Type": content_type} if content_type else {})}


class RemoteReward:
    """A RewardFn scored by a reward server: `(images, prompts) -> Tensor[B]` over HTTP.

    `wait_s`: how long an unreachable server is waited for (retries with backoff, at most `timeout_s` per
    attempt) before RewardServerLost; at most `max_in_flight` requests at once; the token from SOLRL_REWARD_TOKEN.
    `expect` (the reward's reward_args, if the config gives any) must equal what the server hosts.
    """

    remote = True  # scored over the network: the rollouts overlap it with sampling (Rollouts.overlaps)

    def __init__(self, name: str, url: str, wait_s: float = 600.0, timeout_s: float = 120.0, max_in_flight: int = 4,
                 expect: dict[str, str] | None = None) -> None:  # fmt: skip
        self.name, self.url, self.wait_s, self.timeout_s = name, url.rstrip("/"), float(wait_s), float(timeout_s)
        self.token = os.environ.get(TOKEN_ENV) or None
        self._slots = threading.BoundedSemaphore(max_in_flight)
        self.lost: str | None = None  # set when the server was given up on: later calls fail at once (the run stops)
        self.info = self.handshake(expect or {})
        self.video = bool(self.info.get("video", False))

    def __repr__(self) -> str:
        return f"RemoteReward({self.name!r} at {self.url})"

    def _request(self, path: str, body: bytes | None = None, content_type: str | None = None) -> Any:
        """One request, retried while the server cannot be reached (or answers 503) for up to wait_s. Once one
        request gave up, the others fail at once: the run is stopping, and batches still queued behind it must not
        wait wait_s each before the process can exit."""
        if self.lost is not None:
            raise RewardServerLost(self.lost)
        start, delay, last = time.monotonic(), 0.25, ""
        while True:
            req = urllib.request.Request(self.url + path, data=body, headers=_headers(self.token, content_type),
                                         method="POST" if body is not None else "GET")  # fmt: skip
            try:
                with self._slots, urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                    return json.loads(resp.read())
            except urllib.error.HTTPError as e:
                detail = e.read().decode(errors="replace")[:500]
                if e.code != 503:
                    raise RewardRefused(f"reward server {self.url} refused {path}: HTTP {e.code}: {detail}") from None
                last = f"HTTP 503: {detail}"
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as e:
                last = f"{type(e).__name__}: {getattr(e, 'reason', e)}"
            waited = time.monotonic() - start
            if waited >= self.wait_s or self.lost is not None:
                self.lost = self.lost or (
                    f"reward server {self.url} ({self.name}) unreachable for {waited:.0f} s (reward_wait_s="
                    f"{self.wait_s:g}); last error: {last}. Start the server again, then rerun (a run stopped mid-way "
                    "continues with --resume; nothing of its unfinished iteration was recorded)"
                )
                raise RewardServerLost(self.lost)
            log.warning("reward server %s unreachable (%s); retrying for up to %.0f s more", self.url, last,
                        self.wait_s - waited)  # fmt: skip
            time.sleep(min(delay, max(0.0, self.wait_s - waited)))
            delay = min(delay * 2, 10.0)

    def handshake(self, expect: dict[str, str]) -> dict[str, Any]:
        """The server's description of this reward; RewardRefused where it speaks another protocol, does not host
        the reward, or hosts it with other arguments than `expect`."""
        health = self._request("/health")
        if health.get("protocol") != PROTOCOL:
            raise RewardRefused(f"reward server {self.url} speaks protocol {health.get('protocol')!r}, this client "
                                f"{PROTOCOL}: run a server of the same solrl-engine release")  # fmt: skip
        hosted = health.get("rewards", {})
        if self.name not in hosted:
            raise RewardRefused(f"reward server {self.url} hosts {sorted(hosted)}, not {self.name!r}: point reward_url "
                                f"at the server of {self.name} (solrl reward-serve {self.name})")  # fmt: skip
        info = hosted[self.name]
        args = {k: str(v) for k, v in info.get("args", {}).items()}
        differ = {k: (v, args.get(k)) for k, v in expect.items() if args.get(k) != str(v)}
        if differ:
            said = "; ".join(f"{self.name}.{k}: config {a!r}, server {b!r}" for k, (a, b) in differ.items())
            raise RewardRefused(f"reward server {self.url} hosts {self.name} with other arguments ({said}): restart it "
                                "with the run's reward_args, or drop them from the config")  # fmt: skip
        return info

    def check_prompts(self, prompts: list[str]) -> None:
        """The server's reward checks the prompts (the shapes grammar), as an in-process one would."""
        body = json.dumps({"protocol": PROTOCOL, "prompts": list(prompts)}).encode()
        got = self._request(f"/check/{self.name}", body, "application/json")
        if not got.get("ok", False):
            from solrl_engine.data.shapes import PromptError

            raise PromptError(got.get("error", "the reward server rejected a prompt"))

    def __call__(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        # a non-finite image has no score: NaN here, as an in-process reward gives it (the run's nonfinite_policy
        # then decides); the server is sent the finite ones only
        ok = torch.isfinite(images.reshape(len(prompts), -1)).all(dim=1).cpu()
        out = torch.full((len(prompts),), float("nan"))
        if bool(ok.any()):
            keep = ok.nonzero().flatten().tolist()
            body = encode_request(self.name, images[ok.to(images.device)], [prompts[i] for i in keep])
            got = self._request(f"/score/{self.name}", body, "application/octet-stream")
            out[ok] = check_scores(got.get("scores"), len(keep), f"reward server {self.url} ({self.name})")
        return out.to(images.device)
