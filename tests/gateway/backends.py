"""Worker backends for the gateway tests: real HTTP servers (aiohttp, each on its own
loopback port and event loop thread) that answer the OpenAI endpoints as an engine does
(SSE streams, usage with cached tokens), record every body and header they receive, and
fail, break off, stall or report unhealthy on demand."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import orjson
from aiohttp import web


@dataclass
class Received:
    path: str
    body: bytes
    headers: dict[str, str]


@dataclass
class Backend:
    """What the test controls and observes of one backend."""

    name: str
    #: ``ok``; ``fail`` (500 before any byte); ``reject`` (400); ``hang`` (no byte for 30 s); ``break``
    #: (a stream cut off after two chunks). A worker whose engine is gone is a port with
    #: nothing listening (``closed_port``).
    mode: str = "ok"
    health: int = 200
    chunks: int = 4
    #: Seconds between two chunks of a stream.
    delay_s: float = 0.0
    #: When set, the stream waits after its first chunk until it is set (then goes on).
    gate: threading.Event | None = None
    cached_tokens: int = 0
    received: list[Received] = field(default_factory=list)
    health_checks: int = 0
    cancelled: int = 0
    completed: int = 0
    #: Each stream's chunks: when it sent them (monotonic), for the incremental test.
    sent_at: list[list[float]] = field(default_factory=list)
    #: Text → token ids, for ``POST /tokenize`` (vLLM's).
    tokenize: Callable[[str], list[int]] | None = None
    port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def requests(self, path: str = "") -> list[Received]:
        return [r for r in self.received if r.path.endswith(path)]


def _usage(prompt_tokens: int, completion: int, cached: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _app(b: Backend) -> web.Application:
    async def health(_: web.Request) -> web.Response:
        b.health_checks += 1
        return web.Response(status=b.health)

    async def generate(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        b.received.append(Received(request.path, raw, {k.lower(): v for k, v in request.headers.items()}))
        if b.mode == "fail":
            return web.json_response({"error": {"message": "engine died", "type": "internal"}}, status=500)
        if b.mode == "reject":  # the engine's own refusal (a context too long, say)
            return web.json_response({"error": {"message": "too long", "type": "BadRequestError", "param": None,
                                                "code": 400}}, status=400)
        if b.mode == "hang":
            await asyncio.sleep(30)
        body = orjson.loads(raw)
        chat = request.path.endswith("/chat/completions")
        model = body.get("model")
        usage = _usage(7, b.chunks, b.cached_tokens)
        if not body.get("stream"):
            if b.delay_s:
                await asyncio.sleep(b.delay_s * b.chunks)
            text = "".join(f"t{i} " for i in range(b.chunks))
            choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"} if chat
                      else {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"})
            b.completed += 1
            return web.json_response({
                "id": f"{b.name}-1", "object": "chat.completion" if chat else "text_completion", "created": 1,
                "model": model, "choices": [choice], "usage": usage,
            }, headers={"x-engine": b.name})
        resp = web.StreamResponse(headers={"content-type": "text/event-stream", "x-engine": b.name})
        await resp.prepare(request)
        times: list[float] = []
        b.sent_at.append(times)

        def event(delta: dict | None, text: str | None, finish: str | None, with_usage: bool = False) -> bytes:
            choices = [] if with_usage else [
                {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish} if chat
                else {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            ]
            chunk = {"id": f"{b.name}-1", "object": "chat.completion.chunk" if chat else "text_completion",
                     "created": 1, "model": model, "choices": choices}
            if with_usage:
                chunk["usage"] = usage
            return b"data: " + orjson.dumps(chunk) + b"\n\n"

        try:
            if chat:  # engines open a chat stream with the role, no content yet
                await resp.write(event({"role": "assistant", "content": ""}, None, None))
            for i in range(b.chunks):
                last = i == b.chunks - 1
                times.append(time.monotonic())  # before the write: the client may read it at once
                await resp.write(event({"content": f"t{i} "}, f"t{i} ", "length" if last else None))
                if i == 0 and b.gate is not None:
                    while not b.gate.is_set():
                        await asyncio.sleep(0.01)
                if b.mode == "break" and i == 1:
                    request.transport.close()  # the engine dies mid-stream
                    return resp
                if b.delay_s:
                    await asyncio.sleep(b.delay_s)
            if (body.get("stream_options") or {}).get("include_usage"):
                await resp.write(event(None, None, None, with_usage=True))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionResetError:
            b.cancelled += 1  # the gateway closed the connection: its client left
            return resp
        except asyncio.CancelledError:
            b.cancelled += 1
            raise
        b.completed += 1
        return resp

    async def embeddings(request: web.Request) -> web.Response:
        raw = await request.read()
        b.received.append(Received(request.path, raw, {k.lower(): v for k, v in request.headers.items()}))
        return web.json_response({"object": "list", "model": orjson.loads(raw)["model"],
                                  "data": [{"object": "embedding", "index": 0, "embedding": [0.5, 0.25]}],
                                  "usage": {"prompt_tokens": 2, "total_tokens": 2}})

    async def tokenize(request: web.Request) -> web.Response:
        raw = await request.read()
        b.received.append(Received(request.path, raw, {k.lower(): v for k, v in request.headers.items()}))
        body = orjson.loads(raw)
        assert b.tokenize is not None
        tokens = b.tokenize(body["prompt"])
        return web.json_response({"count": len(tokens), "max_model_len": 1 << 20, "tokens": tokens})

    app = web.Application()
    app.router.add_post("/tokenize", tokenize)
    app.router.add_get("/health", health)
    app.router.add_post("/v1/completions", generate)
    app.router.add_post("/v1/chat/completions", generate)
    app.router.add_post("/v1/embeddings", embeddings)
    return app


@contextmanager
def running(*backends: Backend) -> Iterator[tuple[Backend, ...]]:
    """Serve each backend on a free loopback port (one event loop thread for all)."""
    loop = asyncio.new_event_loop()
    runners: list[web.AppRunner] = []
    started = threading.Event()

    async def start() -> None:
        for b in backends:
            runner = web.AppRunner(_app(b), handle_signals=False, shutdown_timeout=1)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            b.port = site._server.sockets[0].getsockname()[1]
            runners.append(runner)
        started.set()

    thread = threading.Thread(target=lambda: (loop.run_until_complete(start()), loop.run_forever()), daemon=True)
    thread.start()
    assert started.wait(10), "backends did not start"
    try:
        yield backends
    finally:
        async def stop() -> None:
            for r in runners:
                await r.cleanup()

        asyncio.run_coroutine_threadsafe(stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def closed_port() -> int:
    """A loopback port with nothing listening (a worker whose engine is gone)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
