"""`solrl reward-serve NAME[,NAME...]`: registered rewards served over HTTP (aiohttp), for `reward_url` clients.

Endpoints: GET /health (protocol, engine version, each hosted reward's model and arguments: the client's
handshake), POST /score/NAME (remote.encode_request's body -> {"scores": [...]}), POST /check/NAME (prompts ->
{"ok": ...}: the reward's own prompt check). Concurrent requests for a reward are batched up to `max_batch` images
of one shape and dtype; scoring runs on a worker thread, so /health answers while a batch is scored. It binds
127.0.0.1 unless told otherwise; with SOLRL_REWARD_TOKEN set, a request without that bearer token is refused.
A request over `max_bytes` is refused with 413, a malformed one with 400 naming the problem, a score that is
not one finite number per image with 500: a client never records it.
"""

from __future__ import annotations

import asyncio
import hmac
import inspect
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from solrl_engine.rewards import _factory, load_reward, parse_reward_spec
from solrl_engine.rewards.remote import MAX_REQUEST_BYTES, PROTOCOL, TOKEN_ENV, check_scores, decode_request

log = logging.getLogger("solrl_engine.rewards")


@dataclass
class _Pending:
    images: torch.Tensor
    prompts: list[str]
    done: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


@dataclass
class Hosted:
    """One served reward: its scorer, what the handshake reports, its queue of pending requests."""

    name: str
    fn: Any
    info: dict[str, Any]
    queue: asyncio.Queue | None = None


def _engine_version() -> str:
    try:
        from importlib.metadata import version

        return version("solrl-engine")
    except Exception:  # noqa: BLE001 - a source checkout that is not installed
        return "unknown"


def host(names: str, args: dict[str, dict[str, str]] | None = None, device: str | None = None) -> list[Hosted]:
    """Load each named reward (its reward_args; `device` where the reward takes one) for serving."""
    args = args or {}
    out = []
    for name, _ in parse_reward_spec(names):
        kw = dict(args.get(name, {}))
        if device is not None and "device" in inspect.signature(_factory(name)).parameters:  # shapes has none
            kw.setdefault("device", device)
        fn = load_reward(name, {name: kw}).parts[0][2]
        model = kw.get("model") or getattr(fn, "model_id", None) or type(fn).__name__
        info = {"model": str(model), "args": {k: str(v) for k, v in kw.items()}, "video": bool(getattr(fn, "video",
                False)), "input": "images [B, 3, H, W] (or clips [B, T, 3, H, W]) in [0, 1], float32 or float16"}
        out.append(Hosted(name, fn, info))
    return out


def make_app(hosted: list[Hosted], max_batch: int = 64, max_bytes: int = MAX_REQUEST_BYTES, token: str | None = None,
             batch_window_s: float = 0.002) -> Any:  # fmt: skip
    """The aiohttp application serving `hosted`."""
    from aiohttp import web

    table = {h.name: h for h in hosted}
    lock = asyncio.Lock()  # one scoring at a time: the rewards share the server's device

    def refuse(status: int, message: str) -> web.Response:
        return web.json_response({"error": message}, status=status)

    @web.middleware
    async def auth(request: web.Request, handler: Any) -> web.StreamResponse:
        if token:
            got = request.headers.get("Authorization", "")
            if not hmac.compare_digest(got.encode(), f"Bearer {token}".encode()):
                return refuse(401, f"missing or wrong token: set {TOKEN_ENV} to the server's token on the client")
        return await handler(request)

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"ok": True, "protocol": PROTOCOL, "engine": _engine_version(),
                                  "rewards": {h.name: h.info for h in hosted}})  # fmt: skip

    def reward_of(request: web.Request) -> Hosted | web.Response:
        name = request.match_info["name"]
        if name not in table:
            return refuse(404, f"this server hosts {sorted(table)}, not {name!r}")
        return table[name]

    async def worker(h: Hosted) -> None:
        """Take one pending request, gather the others of the same shape and dtype up to max_batch, score once."""
        assert h.queue is not None
        while True:
            batch = [await h.queue.get()]
            await asyncio.sleep(batch_window_s)  # let concurrent requests arrive
            rest: list[_Pending] = []
            while not h.queue.empty():
                p = h.queue.get_nowait()
                same = p.images.shape[1:] == batch[0].images.shape[1:] and p.images.dtype == batch[0].images.dtype
                n = sum(len(b.prompts) for b in batch)
                (batch if same and n + len(p.prompts) <= max_batch else rest).append(p)
            for p in rest:
                h.queue.put_nowait(p)
            images = batch[0].images if len(batch) == 1 else torch.cat([b.images for b in batch])
            prompts = [q for b in batch for q in b.prompts]
            try:
                async with lock:
                    scores = await asyncio.to_thread(h.fn, images, prompts)
                scores = check_scores(scores.detach().float().cpu().tolist() if isinstance(scores, torch.Tensor)
                                      else scores, len(prompts), f"reward {h.name!r}")  # fmt: skip
            except Exception as e:  # noqa: BLE001 - the error goes back to each client of the batch
                for b in batch:
                    if not b.done.done():
                        b.done.set_exception(e)
                continue
            at = 0
            for b in batch:
                if not b.done.done():
                    b.done.set_result(scores[at : at + len(b.prompts)].tolist())
                at += len(b.prompts)

    async def score(request: web.Request) -> web.Response:
        h = reward_of(request)
        if isinstance(h, web.Response):
            return h
        try:
            head, images = decode_request(await request.read())
        except ValueError as e:
            return refuse(400, str(e))
        if head.get("reward") != h.name:
            return refuse(400, f"the request is for {head.get('reward')!r}, sent to /score/{h.name}")
        if not torch.isfinite(images).all():
            return refuse(400, "the images hold NaN or Inf: nothing scored")
        p = _Pending(images, head["prompts"])
        assert h.queue is not None
        await h.queue.put(p)
        try:
            return web.json_response({"scores": await p.done})
        except Exception as e:  # noqa: BLE001 - the reward's own failure, named
            return refuse(500, f"reward {h.name!r} failed: {type(e).__name__}: {e}")

    async def check(request: web.Request) -> web.Response:
        h = reward_of(request)
        if isinstance(h, web.Response):
            return h
        try:
            prompts = json.loads(await request.read())["prompts"]
        except (ValueError, KeyError, TypeError):
            return refuse(400, 'send {"prompts": [...]}')
        fn = getattr(h.fn, "check_prompts", None)
        try:
            if fn is not None:
                fn(list(prompts))
        except ValueError as e:
            return web.json_response({"ok": False, "error": str(e)})
        return web.json_response({"ok": True})

    workers: list[asyncio.Task] = []

    async def start(app: web.Application) -> None:
        for h in hosted:
            h.queue = asyncio.Queue()
        workers.extend(asyncio.create_task(worker(h)) for h in hosted)

    async def stop(app: web.Application) -> None:
        for t in workers:
            t.cancel()

    async def too_large(request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPRequestEntityTooLarge:
            why = (f"the request is over the server's limit of {max_bytes} bytes: send fewer images per request "
                   "(rollout_batch_size), or start the server with a larger --max-bytes")  # fmt: skip
            return refuse(413, why)

    app = web.Application(client_max_size=max_bytes, middlewares=[auth, web.middleware(too_large)])
    app.add_routes([web.get("/health", health), web.post("/score/{name}", score), web.post("/check/{name}", check)])
    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    return app


def serve_in_thread(hosted: list[Hosted], host_name: str = "127.0.0.1", **app_options: Any) -> tuple[str, Any]:
    """Serve `hosted` (make_app, `app_options` its keywords) on a free port of `host_name`, on an event loop in a
    daemon thread of this process: (its URL, a function that stops it). For benches and tests that host a reward
    of their own; `serve` is the command's blocking server."""
    import socket
    import threading

    from aiohttp import web

    with socket.socket() as s:
        s.bind((host_name, 0))
        port = s.getsockname()[1]
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    async def up() -> Any:
        runner = web.AppRunner(make_app(hosted, **app_options))
        await runner.setup()
        await web.TCPSite(runner, host_name, port).start()
        return runner

    runner = asyncio.run_coroutine_threadsafe(up(), loop).result(30)

    def stop() -> None:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)

    return f"http://{host_name}:{port}", stop


def serve(names: str, args: dict[str, dict[str, str]] | None = None, host_name: str = "127.0.0.1", port: int = 8000,
          device: str | None = None, max_batch: int = 64, max_bytes: int = MAX_REQUEST_BYTES) -> None:  # fmt: skip
    """Load the rewards and serve them until interrupted."""
    from aiohttp import web

    hosted = host(names, args, device)
    token = os.environ.get(TOKEN_ENV) or None
    if host_name not in ("127.0.0.1", "localhost", "::1") and not token:
        log.warning("serving on %s without a token: anyone who reaches it can use the reward; set %s", host_name,
                    TOKEN_ENV)  # fmt: skip
    print(f"serving {', '.join(h.name for h in hosted)} on http://{host_name}:{port} (protocol {PROTOCOL}"
          f"{', token required' if token else ''})", flush=True)  # fmt: skip
    web.run_app(make_app(hosted, max_batch, max_bytes, token), host=host_name, port=port, print=None)
