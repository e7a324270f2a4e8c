"""The emulated engine's HTTP API (aiohttp): vLLM's OpenAI-compatible routes, ``/tokenize``,
the ``/render`` routes vllm-router calls, ``/health`` (and ``/ping``), ``/version``,
``/v1/models``, ``/metrics``.

Every failure is an answer: a refused request gets vLLM's error body (400, or 404 for an
unknown model), an unexpected one a 500 with the same shape (logged); a client that goes
away aborts its request (its blocks are freed), as vLLM aborts it.

With ``--data-parallel-size N`` the server fronts N engines (DP ranks), as vLLM's API
server fronts its engine cores: ``X-data-parallel-rank`` picks one, vLLM's balancing
otherwise; ``/metrics`` and ``/reset_prefix_cache`` cover them all.

With ``--role prefill|decode`` a request may be one leg of a disaggregated request
(kvstream.emulator.handoff); a prefill engine with the bootstrap hand-off also serves
SGLang's bootstrap server on ``--bootstrap-port``.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from kvstream.emulator import handoff, protocol
from kvstream.emulator.engine import Engine, Ticket
from kvstream.emulator.errors import EmulatorConfigError, RequestError
from kvstream.emulator.metrics import exposition
from kvstream.emulator.options import EmulatorOptions
from kvstream.emulator.scheduler import PLACEHOLDER_TOKEN
from kvstream.emulator.tokenizer import EngineTokenizer
from kvstream.logs import get_logger

_log = get_logger(__name__)
#: The vLLM release whose API, scheduling and KV events the emulator follows.
VLLM_VERSION = "0.33.0"
#: vLLM's header naming the rank of a request (its index among the server's ranks).
DP_RANK_HEADER = "X-data-parallel-rank"
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


def engine_ids(options: EmulatorOptions) -> list[str]:
    """The KV connector engine id of each rank: one uuid, suffixed ``_dp<rank>`` when
    data-parallel, as vLLM's engine cores suffix it (v1/engine/core.py)."""
    base = str(uuid.uuid4())
    if options.data_parallel_size == 1 and options.data_parallel_rank == 0:
        return [base]
    return [f"{base}_dp{rank}" for rank in options.ranks]


class Api:
    def __init__(self, engines: list[Engine], options: EmulatorOptions, tokenizer: EngineTokenizer, host: str,
                 port: int, session: aiohttp.ClientSession | None = None) -> None:
        self.engines = engines
        self.options = options
        self.tokenizer = tokenizer
        #: Where this engine listens: a nixl prefill leg's answer names it.
        self.host = host
        self.port = port
        #: The bootstrap hand-off: a prefill engine's rooms (served on --bootstrap-port),
        #: a decode engine's client of the prefill engines' bootstrap servers.
        self.rooms = handoff.Rooms()
        self.session = session
        self.created = int(time.time())

    def _parse(self, body: Any, chat: bool, request_id: str | None) -> protocol.Generation:
        o = self.options
        return protocol.parse(body, chat=chat, served=o.model, max_model_len=o.max_model_len, tokenizer=self.tokenizer,
                              request_id=request_id)

    def _rank(self, request: web.Request) -> int | None:
        """The header's rank index, as vLLM reads it: one that is no integer is ignored
        (vLLM's ``_get_data_parallel_rank``), one out of range is vLLM's 400."""
        header = request.headers.get(DP_RANK_HEADER)
        try:
            index = int(header) if header is not None else None
        except ValueError:
            return None
        if index is not None and not 0 <= index < len(self.engines):
            raise RequestError(f"data_parallel_rank {index} is out of range [0, {len(self.engines)}).")
        return index

    def _engine(self, index: int | None) -> Engine:
        """The header's rank, else the least loaded, the first of equals (vLLM's balancing
        from its one API server's start index 0; see :attr:`Engine.load`)."""
        return self.engines[index] if index is not None else min(self.engines, key=lambda e: e.load)

    def _text(self, n: int) -> str:
        return self.tokenizer.decode([PLACEHOLDER_TOKEN] * n)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        body = await _body(request)
        leg = handoff.leg(body, self.options)
        index = self._rank(request)  # a bad rank is refused before the room opens
        room = leg.room if leg.send else None  # a bootstrap prefill leg's
        if room is not None:
            self.rooms.open(room)
        ticket: Ticket | None = None
        engine: Engine | None = None
        try:
            g = self._parse(body, chat, request.headers.get("X-Request-Id"))
            if room is not None:
                g = dataclasses.replace(g, max_tokens=1)  # SGLang's prefill answers after its one step
            if leg.receive and leg.bootstrap is not None:
                assert self.session is not None
                await handoff.receive(self.session, leg, len(g.prompt))
            # Chosen at submission (no await between): the ranks' loads are current.
            engine = self._engine(index)
            # vLLM's engine request id: the response's id and 8 random characters.
            ticket = engine.submit(g.prompt, g.max_tokens, stream=g.stream, cache_salt=g.cache_salt,
                                   request_id=f"{g.request_id}-{uuid.uuid4().hex[:8]}", receive_kv=leg.receive)
            try:
                return await self._answer(request, g, engine, ticket, leg)
            finally:
                engine.abort(ticket)
        finally:
            if room is not None:
                self.rooms.close(room, ticket.request if ticket else None, engine.engine_id if engine else None)

    async def _answer(self, request: web.Request, g: protocol.Generation, engine: Engine, ticket: Ticket,
                      leg: handoff.Leg) -> web.StreamResponse:
        req = ticket.request
        if not g.stream:
            while await ticket.next_tokens() or not req.finished:
                pass
            params = None
            if leg.send and leg.room is None:  # a nixl prefill leg
                params = handoff.nixl_params(req, engine.engine_id, self.options.block_size, self.host, self.port)
            return web.json_response(protocol.response(g, self._text(req.num_output), req.num_output,
                                                       req.cached_tokens or 0, params))
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
            pass  # the client went away mid-stream: the request is aborted by the caller
        return resp

    async def render_completion(self, request: web.Request) -> web.Response:
        return web.json_response([protocol.render(self._parse(await _body(request), False,
                                                              request.headers.get("X-Request-Id")))])

    async def render_chat(self, request: web.Request) -> web.Response:
        return web.json_response(protocol.render(self._parse(await _body(request), True,
                                                             request.headers.get("X-Request-Id"))))

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
        data = exposition([e.metrics for e in self.engines])
        return web.Response(body=data, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        # Every rank tries; the answer is whether all did (vLLM's DP client: all()).
        if not all([e.reset_prefix_cache() for e in self.engines]):
            raise RequestError("the prefix cache cannot be reset while requests hold blocks", status=409,
                               err_type="ConflictError")
        return web.Response(status=200)


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def make_app(options: EmulatorOptions, host: str = "127.0.0.1", port: int = 8000) -> web.Application:
    """The app listening on ``host:port``; the engines (and their KV-event sockets, the
    bootstrap server or client) start with it and stop with it."""
    tokenizer = EngineTokenizer(options.tokenizer, options.chat_template)
    app = web.Application(middlewares=[_errors], client_max_size=64 * 1024 * 1024)

    async def lifecycle(app: web.Application) -> Any:
        ranks: list[Engine] = []
        bootstrap = options.handoff == "bootstrap"
        session = aiohttp.ClientSession() if bootstrap and options.role == "decode" else None
        server: web.AppRunner | None = None
        try:
            for rank, engine_id in zip(options.ranks, engine_ids(options), strict=True):
                ranks.append(Engine(options, rank, engine_id))  # binds its KV-event sockets
                ranks[-1].start()
            api = Api(ranks, options, tokenizer, host, port, session)
            app[_API] = api
            if bootstrap and options.role == "prefill":
                assert options.bootstrap_port is not None
                server = web.AppRunner(api.rooms.app(), handler_cancellation=True, access_log=None)
                await server.setup()
                try:
                    await web.TCPSite(server, host, options.bootstrap_port).start()
                except OSError as exc:
                    raise EmulatorConfigError(
                        f"cannot listen on bootstrap port {host}:{options.bootstrap_port}: {exc.strerror}") from None
            yield
        finally:
            if server is not None:
                await server.cleanup()
            if session is not None:
                await session.close()
            for engine in ranks:
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
