"""The emulated engine's HTTP API (aiohttp): vLLM's OpenAI-compatible routes, ``/tokenize``,
the ``/render`` routes vllm-router calls, ``/health`` (and ``/ping``), ``/version``,
``/v1/models``, ``/metrics``.

Every failure is an answer: a refused request gets vLLM's error body (400, or 404 for an
unknown model), an unexpected one a 500 with the same shape (logged); a client that goes
away aborts its request (its blocks are freed), as vLLM aborts it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvstream.emulator import protocol
from kvstream.emulator.engine import Engine
from kvstream.emulator.errors import RequestError
from kvstream.emulator.options import EmulatorOptions
from kvstream.emulator.scheduler import PLACEHOLDER_TOKEN
from kvstream.emulator.tokenizer import EngineTokenizer
from kvstream.logs import get_logger

_log = get_logger(__name__)
#: The vLLM release whose API, scheduling and KV events the emulator follows.
VLLM_VERSION = "0.33.0"
_ENGINE = web.AppKey("engine", Engine)
_API = web.AppKey("api", "Api")


def _error(exc: RequestError) -> web.Response:
    return web.json_response(exc.body(), status=exc.status)


@web.middleware
async def _errors(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                  ) -> web.StreamResponse:
    try:
        return await handler(request)
    except RequestError as exc:
        return _error(exc)
    except web.HTTPException:
        raise
    except Exception as exc:  # noqa: BLE001 - every failure is an answer, never a dropped connection
        _log.exception("emulate.internal_error", path=request.path)
        return _error(RequestError(f"internal error: {exc}", status=500, err_type="InternalServerError"))


async def _body(request: web.Request) -> Any:
    try:
        return json.loads(await request.read())
    except (ValueError, UnicodeDecodeError) as exc:
        raise RequestError(f"JSON decode error: {exc}") from None


class Api:
    def __init__(self, engine: Engine, options: EmulatorOptions, tokenizer: EngineTokenizer) -> None:
        self.engine = engine
        self.options = options
        self.tokenizer = tokenizer
        self.created = int(time.time())

    def _parse(self, body: Any, chat: bool) -> protocol.Generation:
        o = self.options
        return protocol.parse(body, chat=chat, served=o.model, max_model_len=o.max_model_len, tokenizer=self.tokenizer)

    def _text(self, n: int) -> str:
        return self.tokenizer.decode([PLACEHOLDER_TOKEN] * n)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        g = self._parse(await _body(request), chat)
        ticket = self.engine.submit(g.prompt, g.max_tokens, stream=g.stream, cache_salt=g.cache_salt)
        req = ticket.request
        try:
            if not g.stream:
                while await ticket.next_tokens() or not req.finished:
                    pass
                return web.json_response(protocol.response(g, self._text(req.num_output), req.num_output,
                                                           req.cached_tokens or 0))
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                               "Cache-Control": "no-cache"})
            try:
                await resp.prepare(request)
                first = True
                while True:
                    n = await ticket.next_tokens()
                    if not n:
                        break
                    done = req.finished and not ticket.pending
                    await resp.write(_sse(protocol.chunk(g, self._text(n), done, first=first)))
                    first = False
                    if done:
                        break
                if g.include_usage:
                    await resp.write(_sse(protocol.usage_chunk(g, req.num_output, req.cached_tokens or 0)))
                await resp.write(b"data: [DONE]\n\n")
                await resp.write_eof()
            except ConnectionResetError:
                pass  # the client went away mid-stream: the request is aborted below
            return resp
        finally:
            self.engine.abort(ticket)

    async def render_completion(self, request: web.Request) -> web.Response:
        return web.json_response([protocol.render(self._parse(await _body(request), False))])

    async def render_chat(self, request: web.Request) -> web.Response:
        return web.json_response(protocol.render(self._parse(await _body(request), True)))

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await _body(request)
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object")
        if "messages" in body:
            ids = self.tokenizer.chat_ids(body)
        elif isinstance(body.get("prompt"), str):
            text = body["prompt"]
            ids = self.tokenizer.completion_ids(text) if body.get("add_special_tokens", True) is not False \
                else self.tokenizer.encode(text, False)
        else:
            raise RequestError("prompt must be a string (or send messages)", param="prompt")
        return web.json_response({"count": len(ids), "max_model_len": self.options.max_model_len, "tokens": ids,
                                  "token_strs": None})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": VLLM_VERSION})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(protocol.model_list(self.options.model, self.options.max_model_len, self.created))

    async def metrics(self, request: web.Request) -> web.Response:
        data = generate_latest(self.engine.metrics.registry)
        return web.Response(body=data, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        if not self.engine.reset_prefix_cache():
            raise RequestError("the prefix cache cannot be reset while requests hold blocks", status=409,
                               err_type="ConflictError")
        return web.Response(status=200)


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def make_app(options: EmulatorOptions) -> web.Application:
    """The app; the engine (and its KV-event sockets) starts with it and stops with it."""
    tokenizer = EngineTokenizer(options.tokenizer, options.chat_template)
    app = web.Application(middlewares=[_errors], client_max_size=64 * 1024 * 1024)

    async def lifecycle(app: web.Application) -> Any:
        engine = Engine(options)
        engine.start()
        api = Api(engine, options, tokenizer)
        app[_ENGINE] = engine
        app[_API] = api
        yield
        await engine.close()

    app.cleanup_ctx.append(lifecycle)

    def route(name: str) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def call(request: web.Request) -> web.StreamResponse:
            return await getattr(request.app[_API], name)(request)  # type: ignore[no-any-return]
        return call

    app.router.add_post("/v1/completions", route("completions"))
    app.router.add_post("/v1/chat/completions", route("chat"))
    app.router.add_post("/v1/completions/render", route("render_completion"))
    app.router.add_post("/v1/chat/completions/render", route("render_chat"))
    app.router.add_post("/tokenize", route("tokenize"))
    app.router.add_get("/health", route("health"))
    app.router.add_get("/ping", route("health"))
    app.router.add_post("/ping", route("health"))
    app.router.add_get("/version", route("version"))
    app.router.add_get("/v1/models", route("models"))
    app.router.add_get("/metrics", route("metrics"))
    app.router.add_post("/reset_prefix_cache", route("reset_prefix_cache"))
    return app
