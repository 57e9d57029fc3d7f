"""Rewards as services: `solrl reward-serve` in a real process on 127.0.0.1, and the `reward_url` client.

A remote score equals the in-process one bit for bit (lossless wire format); the handshake refuses a server of
another reward or other arguments, a wrong token, an oversized or malformed request, NaN images; an unreachable
server is waited for, then the run stops resumably naming the URL; a server killed and restarted mid-run costs
nothing: the run's metrics equal the in-process run's.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch

pytest.importorskip("aiohttp", reason="the reward server needs aiohttp (the dev extra installs it)")

from solrl_engine.data import shapes  # noqa: E402
from solrl_engine.rewards import load_reward  # noqa: E402
from solrl_engine.rewards.remote import (  # noqa: E402
    RemoteReward,
    RewardRefused,
    RewardServerLost,
    decode_request,
    encode_request,
    parse_reward_urls,
)
from solrl_engine.rl.config import ConfigError, RLConfig  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`solrl reward-serve` in its own process, started and stopped by the test."""

    def __init__(self, rewards: str = "shapes", *extra: str, token: str | None = None) -> None:
        self.port, self.rewards, self.extra, self.token = _free_port(), rewards, extra, token
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> Server:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        env.pop("SOLRL_REWARD_TOKEN", None)
        if self.token:
            env["SOLRL_REWARD_TOKEN"] = self.token
        self.proc = subprocess.Popen([sys.executable, "-m", "solrl_engine.cli", "reward-serve", self.rewards,
                                      "--port", str(self.port), *self.extra], env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)  # fmt: skip
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited: {self.proc.stdout.read()[-2000:]}")  # type: ignore[union-attr]
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.1)
        raise RuntimeError("the server did not start in 60 s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture(scope="module")
def server():
    s = Server().start()
    yield s
    s.stop()


def _batch(n: int = 6, seed: int = 0) -> tuple[torch.Tensor, list[str]]:
    prompts = shapes.prompts("train")[:n]
    images = torch.stack([shapes.render(p, seed + i) for i, p in enumerate(prompts)])
    return images + 0.01 * torch.randn(images.shape, generator=torch.Generator().manual_seed(seed)), prompts


def test_a_remote_score_equals_the_in_process_one(server, monkeypatch):
    monkeypatch.delenv("SOLRL_REWARD_TOKEN", raising=False)
    local = load_reward("shapes")
    remote = load_reward("shapes", urls={"shapes": server.url})
    for dtype in (torch.float32, torch.float16):
        images, prompts = _batch()
        images = images.to(dtype)
        assert torch.equal(remote(images, prompts), local(images, prompts)), dtype
    assert isinstance(remote.parts[0][2], RemoteReward) and remote.parts[0][2].info["model"] == "ShapesReward"
    remote.check_prompts(prompts)  # the server's reward checks the grammar, as the local one does
    with pytest.raises(ValueError, match="not a shapes prompt|grammar|unknown"):
        remote.check_prompts(["a purple dodecahedron"])


def test_concurrent_requests_are_batched_and_each_gets_its_own_scores(server, monkeypatch):
    monkeypatch.delenv("SOLRL_REWARD_TOKEN", raising=False)
    local, remote = load_reward("shapes"), RemoteReward("shapes", server.url)
    batches = [_batch(3, seed) for seed in range(6)]
    got: dict[int, torch.Tensor] = {}
    threads = [threading.Thread(target=lambda i=i, b=b: got.__setitem__(i, remote(*b))) for i, b in enumerate(batches)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for i, (images, prompts) in enumerate(batches):
        assert torch.equal(got[i], local(images, prompts)), i


def test_the_wire_format_is_lossless_and_refuses_what_it_cannot_read():
    images, prompts = _batch(2)
    head, back = decode_request(encode_request("shapes", images, prompts))
    assert torch.equal(back, images) and head["prompts"] == prompts
    body = encode_request("shapes", images, prompts)
    with pytest.raises(ValueError, match="bytes; the request holds"):
        decode_request(body[:-4])
    with pytest.raises(ValueError, match="need 2 prompts"):
        decode_request(encode_request("shapes", images, prompts[:1]))
    with pytest.raises(ValueError, match="protocol"):
        decode_request(body[:4] + body[4:].replace(b'"protocol": 1', b'"protocol": 9', 1))


def _post(url: str, body: bytes, token: str | None = None) -> tuple[int, str]:
    req = urllib.request.Request(url, data=body, method="POST",
                                 headers={"Authorization": f"Bearer {token}"} if token else {})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_bad_requests_are_answered_with_their_reason_and_nothing_is_scored(server, monkeypatch):
    monkeypatch.delenv("SOLRL_REWARD_TOKEN", raising=False)
    images, prompts = _batch(2)
    nan = images.clone()
    nan[0, 0, 0, 0] = float("nan")
    code, text = _post(f"{server.url}/score/shapes", encode_request("shapes", nan, prompts))
    assert code == 400 and "NaN or Inf" in text
    code, text = _post(f"{server.url}/score/pickscore", encode_request("pickscore", images, prompts))
    assert code == 404 and "hosts ['shapes']" in text
    code, text = _post(f"{server.url}/score/shapes", b"\x05\x00\x00\x00{oops")
    assert code == 400 and "not JSON" in text
    with pytest.raises(RewardRefused, match=r"hosts \['shapes'\], not 'pickscore'"):
        RemoteReward("pickscore", server.url)
    with pytest.raises(RewardRefused, match="other arguments"):
        RemoteReward("shapes", server.url, expect={"size": "64"})


def test_a_token_is_required_when_set_and_a_request_over_the_limit_is_refused(monkeypatch):
    s = Server("shapes", "--max-bytes", "50000", token="s3cret").start()
    try:
        monkeypatch.setenv("SOLRL_REWARD_TOKEN", "wrong")
        with pytest.raises(RewardRefused, match="HTTP 401.*SOLRL_REWARD_TOKEN"):
            RemoteReward("shapes", s.url)
        monkeypatch.setenv("SOLRL_REWARD_TOKEN", "s3cret")
        remote = RemoteReward("shapes", s.url)
        images, prompts = _batch(1)
        assert remote(images, prompts).shape == (1,)
        big, many = _batch(6)
        with pytest.raises(RewardRefused, match="HTTP 413.*--max-bytes"):
            remote(big, many)
    finally:
        s.stop()


def test_an_unreachable_server_is_waited_for_then_the_run_stops_naming_it(monkeypatch):
    url = f"http://127.0.0.1:{_free_port()}"
    t0 = time.monotonic()
    with pytest.raises(RewardServerLost, match=rf"{url} \(shapes\) unreachable for .*Start the server again"):
        RemoteReward("shapes", url, wait_s=1.0)
    assert 0.9 < time.monotonic() - t0 < 15


def test_once_the_server_is_given_up_on_later_batches_fail_at_once(monkeypatch):
    """After one request gave up (RewardServerLost), the next fails at once with the same message: batches queued
    behind it on the scoring thread must not each wait reward_wait_s before the stopping run can exit."""
    monkeypatch.delenv("SOLRL_REWARD_TOKEN", raising=False)
    s = Server().start()
    try:
        r = RemoteReward("shapes", s.url, wait_s=1.0)
    finally:
        s.stop()
    images = torch.rand(2, 3, 16, 16)
    with pytest.raises(RewardServerLost, match="unreachable for") as first:
        r(images, ["a red circle"] * 2)
    t0 = time.monotonic()
    with pytest.raises(RewardServerLost) as second:
        r(images, ["a red circle"] * 2)
    assert time.monotonic() - t0 < 0.5 and str(second.value) == str(first.value)


def test_reward_url_is_checked_in_the_config():
    assert parse_reward_urls("a=http://h:1, b=https://x.y:443/") == {"a": "http://h:1", "b": "https://x.y:443"}
    for bad, why in (("shapes=127.0.0.1:8000", "name=http://host:port"), ("shapes=http://h", "name=http://host:port"),
                     ("pickscore=http://h:1", "not part of reward 'shapes'"), ("shapes=http://h:1,shapes=http://h:2",
                                                                              "twice")):  # fmt: skip
        with pytest.raises(ConfigError, match=why):
            RLConfig(reward_url=bad).validate()
    with pytest.raises(ConfigError, match="reward_wait_s"):
        RLConfig(reward_wait_s=-1).validate()
    with pytest.raises(ConfigError, match=r"reward_combine.*'sum', 'group_normalized'"):
        RLConfig(reward_combine="max").validate()


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_run_scored_remotely_equals_the_in_process_run_through_a_server_restart(small_model, tmp_path,
                                                                                  monkeypatch, caplog):  # fmt: skip
    """The trainer with its reward served: the same metrics as in-process (same seeds), while the server is killed
    after the handshake and restarted 2 s later (the first scoring waits for it; nothing scored twice or skipped)."""
    from solrl_engine.rl.trainer import Trainer

    monkeypatch.delenv("SOLRL_REWARD_TOKEN", raising=False)
    cfg = dict(name="remote", model_path=small_model, n=6, k=4, prompts_per_iter=2, preview_steps=2, full_steps=4,
               iterations=2, eval_every=2, eval_prompt_count=2, eval_seeds=1, lora_rank=4, lora_alpha=8, lr=1e-2,
               rollout_batch_size=4, train_batch_size=4, timestep_fraction=0.5)  # fmt: skip
    Trainer(RLConfig(**cfg, output=str(tmp_path / "local")), progress=False).run()
    s = Server().start()
    try:
        tr = Trainer(RLConfig(**cfg, output=str(tmp_path / "remote"), reward_url=f"shapes={s.url}", reward_wait_s=60),
                     progress=False)  # fmt: skip
        s.stop()  # gone after the handshake: the first scoring waits for it
        threading.Timer(2.0, s.start).start()
        with caplog.at_level("WARNING", logger="solrl_engine.rewards"):
            tr.run()
        assert any("unreachable" in r.getMessage() for r in caplog.records)  # it did wait for the restart
    finally:
        time.sleep(2.5)
        s.stop()
    want, got = _records(tmp_path / "local"), _records(tmp_path / "remote")
    assert [r["iter"] for r in got] == [1, 2]
    # batches of 4: the previews (12) and the regenerated samples (8) scored while the next batch was sampled
    assert all(r["time_reward_hidden_s"] > 0 for r in got) and all(r["time_reward_hidden_s"] == 0 for r in want)
    for w, g in zip(want, got, strict=True):
        for key in w:
            if key.startswith("time") or key.endswith("_s") or key == "grad_norm":
                continue
            assert g[key] == w[key], key


def test_a_server_gone_for_good_stops_the_run_resumably_and_the_resumed_run_is_exact(small_model, tmp_path,
                                                                                     monkeypatch):  # fmt: skip
    """The server dies after iteration 1 and stays away past reward_wait_s: iteration 2 stops with
    RewardServerLost naming the URL, nothing of it recorded; restarted, `--resume` finishes the run with the
    metrics of a run that never lost its server (in-process)."""
    from solrl_engine.rl.trainer import Trainer

    monkeypatch.delenv("SOLRL_REWARD_TOKEN", raising=False)
    cfg = dict(name="lost", model_path=small_model, n=6, k=4, prompts_per_iter=2, preview_steps=2, full_steps=4,
               eval_every=2, eval_prompt_count=2, eval_seeds=1, lora_rank=4, lora_alpha=8, lr=1e-2,
               rollout_batch_size=4, train_batch_size=4, timestep_fraction=0.5, save_every=1)  # fmt: skip
    Trainer(RLConfig(**cfg, iterations=2, output=str(tmp_path / "local")), progress=False).run()
    out = tmp_path / "remote"
    s = Server().start()
    try:
        remote = dict(cfg, output=str(out), reward_url=f"shapes={s.url}", reward_wait_s=1.5)
        Trainer(RLConfig(**remote, iterations=1), progress=False).run()
        tr = Trainer(RLConfig(**remote, iterations=2), progress=False)  # the handshake passes ...
        s.stop()  # ... then the server is gone for good
        with pytest.raises(RewardServerLost, match=rf"{s.url} \(shapes\) unreachable.*--resume"):
            tr.run(resume=True)
        assert [r["iter"] for r in _records(out)] == [1]  # nothing of iteration 2 was recorded
        s.start()
        Trainer(RLConfig(**remote, iterations=2), progress=False).run(resume=True)
    finally:
        s.stop()
    want, got = _records(tmp_path / "local"), _records(out)
    assert [r["iter"] for r in got] == [1, 2]
    for w, g in zip(want, got, strict=True):
        for key in w:
            if not (key.startswith("time") or key.endswith("_s") or key == "grad_norm"):
                assert g[key] == w[key], key


@pytest.mark.parametrize(("scores", "why"), [(lambda n: torch.full((n,), float("nan")), "non-finite score"),
                                             (lambda n: torch.zeros(n + 1), "expected 2 numbers")])  # fmt: skip
def test_a_reward_that_answers_nonsense_is_refused_and_nothing_recorded(scores, why, monkeypatch):
    """A served reward giving a NaN or a wrong number of scores: the server answers 500 naming it, the client
    raises with that reason (the run stops), never a score."""
    monkeypatch.delenv("SOLRL_REWARD_TOKEN", raising=False)
    from solrl_engine.rewards.serve import Hosted, serve_in_thread

    url, stop = serve_in_thread([Hosted("shapes", lambda images, prompts: scores(len(prompts)), {"model": "test",
                                                                                                 "args": {}})])
    try:
        images, prompts = _batch(2)
        with pytest.raises(RewardRefused, match=rf"HTTP 500.*{why}.*nothing recorded"):
            RemoteReward("shapes", url)(images, prompts)
    finally:
        stop()


def test_solrl_train_with_no_server_at_start_says_to_run_again_not_to_resume(tmp_path, capsys):
    from solrl_engine.cli import main

    url = f"http://127.0.0.1:{_free_port()}"
    with pytest.raises(SystemExit) as e:
        main(["train", "configs/tiny.py:tiny_sol_rl_shapes", "--output", str(tmp_path / "run"), "--set",
              f"reward_url=shapes={url}", "--set", "reward_wait_s=0.5"])  # fmt: skip
    msg = str(e.value)
    assert f"{url} (shapes) unreachable" in msg and "nothing was started: run the same command again" in msg
    assert "--resume" not in msg.splitlines()[-1] and not (tmp_path / "run").exists()


@pytest.mark.parametrize("objective", ["nft", "flow_grpo"])
def test_sol_rl_with_a_served_reward_explores_and_regenerates_in_halves(small_model, tmp_path, monkeypatch, objective):
    """Sol-RL with scoring that overlaps: the explore and the regeneration in two halves of the prompts (3: halves of
    2 and 1), each half's scores waited for only after the next thing was sampled, so every phase's last batch is
    scored behind sampling except the last regeneration's; the metrics equal the whole-batch order's (Flow-GRPO's
    too: its regenerations' SDE states joined in prompt order)."""
    from solrl_engine.rl.trainer import Trainer
    from solrl_engine.sampling.rollouts import Pending, Rollouts

    cfg = dict(name="halves", model_path=small_model, n=6, k=4, prompts_per_iter=3, preview_steps=2, full_steps=4,
               iterations=1, eval_every=5, lora_rank=4, lora_alpha=8, lr=1e-2, rollout_batch_size=6,
               train_batch_size=4, timestep_fraction=0.5, objective=objective)  # fmt: skip
    metrics = {}
    events: list[tuple] = []
    sample, result = Rollouts.sample, Pending.result

    def logged_sample(self, cond, seeds, steps, transformer=None, tag="", *a, **kw):
        events.append(("sample", steps, len(seeds)))  # previews at 2 steps, regenerations at 4
        return sample(self, cond, seeds, steps, transformer, tag, *a, **kw)

    def logged_result(self):
        events.append(("wait", len(self.prompts)))
        return result(self)

    monkeypatch.setattr(Rollouts, "sample", logged_sample)
    monkeypatch.setattr(Pending, "result", logged_result)
    for overlaps in (False, True):
        monkeypatch.setattr(Rollouts, "overlaps", property(lambda self, o=overlaps: o))
        tr = Trainer(RLConfig(**cfg, output=str(tmp_path / str(overlaps))), progress=False)
        events.clear()
        metrics[overlaps] = tr.step()
    assert events == [("sample", 2, 6), ("sample", 2, 6),  # half 1's previews: 2 prompts x 6 seeds
                      ("sample", 2, 6),  # half 2's (1 prompt), while half 1's last batch is scored
                      ("wait", 12), ("sample", 4, 6), ("sample", 4, 2),  # half 1 ranked and regenerated ...
                      ("wait", 6), ("sample", 4, 4),  # ... while half 2's previews are scored; then half 2's
                      ("wait", 8), ("wait", 4)]  # fmt: skip
    assert metrics[True]["time_reward_hidden_s"] > 0 and metrics[False]["time_reward_hidden_s"] == 0
    for key, want in metrics[False].items():
        if not (key.startswith("time") or key.endswith("_s")):
            assert metrics[True][key] == want, key


def test_a_failed_batch_cancels_the_batches_queued_behind_it(small_model, tmp_path, monkeypatch):
    """A served reward's error surfaces at Pending.result(), and the batches still queued for the scoring thread are
    cancelled, not scored (the run is stopping)."""
    from solrl_engine.rl.runtime import build_rollouts
    from solrl_engine.sampling.rollouts import Rollouts

    cfg = RLConfig(name="q", model_path=small_model, n=6, k=4, prompts_per_iter=2, preview_steps=1, full_steps=1,
                   rollout_batch_size=2, output=str(tmp_path))  # fmt: skip
    ro = build_rollouts(cfg)
    calls = []

    def slow_score(self, x0, prompts):  # noqa: ANN001, ANN202
        calls.append(len(prompts))
        time.sleep(0.5)
        if len(calls) == 1:
            raise RewardServerLost("gone")
        return None  # never joined: the first batch failed

    monkeypatch.setattr(Rollouts, "overlaps", property(lambda self: True))
    monkeypatch.setattr(Rollouts, "score", slow_score)
    pending = ro.start_scored(ro.encode(["a red circle"] * 6), ["a red circle"] * 6, list(range(6)), 1)
    assert len(pending.futures) == 3
    with pytest.raises(RewardServerLost, match="gone"):
        pending.result()
    time.sleep(0.8)  # the batch that had started finishes; the one behind it never starts
    assert calls == [2, 2] and pending.futures[2].cancelled()
