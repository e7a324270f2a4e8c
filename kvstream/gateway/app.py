"""The gateway of a router replica: the OpenAI endpoints mounted on the replica's HTTP app
(kvstream.replica.service), in the same process as its index.

``POST /v1/completions`` and ``/v1/chat/completions`` (streamed or not) are routed by
the prompt's token ids to the candidate holding the longest prefix at the least load;
``POST /v1/embeddings`` goes to the least-loaded worker of the model; ``GET /v1/models``
lists what the directory's workers serve. The candidates are the directory's workers
that serve the request's ``model`` (a model or a LoRA adapter name) and whose breaker
lets requests through (kvstream.gateway.health). The endpoints take the ``client`` scope
token as ``Authorization: Bearer`` (what the openai SDK sends as its api key).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Collection, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio
import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response

from kvstream.gateway import disagg
from kvstream.gateway.errors import (
    ApiError,
    bad_request,
    overloaded,
    unauthorized,
    unavailable,
    unknown_model,
)
from kvstream.gateway.health import WorkerHealth, probe_loop
from kvstream.gateway.metrics import GatewayMetrics
from kvstream.gateway.options import GatewayOptions
from kvstream.gateway.prompts import PromptIds
from kvstream.gateway.relay import Exchange
from kvstream.gateway.request_body import Endpoint, parse, with_prompt_ids
from kvstream.gateway.seams import PromptTokenizer, WorkerDirectory, WorkerEndpoint
from kvstream.gateway.upstream import UpstreamPool
from kvstream.logs import get_logger
from kvstream.replica import request_ids
from kvstream.replica.auth import Scope, Tokens
from kvstream.replica.replica import Replica
from kvstream.router.core import PromptTokens

log = get_logger(__name__)

#: Routing decisions (and load ops) computed at once in threads, while the replica's
#: lock is held by its fold.
ROUTE_THREADS = 4
#: How often a request waiting for the replica to be ready (``ready_wait_s``) looks (s).
READY_POLL_S = 0.01


class Gateway:
    """The OpenAI endpoints of one replica."""

    def __init__(
        self,
        replica: Replica,
        directory: WorkerDirectory,
        options: GatewayOptions | None = None,
        tokenizers: Mapping[str, PromptTokenizer] | None = None,
    ) -> None:
        """``tokenizers``: model name → its tokenizer, for text prompts."""
        self.replica, self.directory = replica, directory
        self.options = o = options or GatewayOptions()
        self.tokens = Tokens.build()  # the app's, once mounted
        self.metrics = GatewayMetrics(replica.metrics.registry)
        self.health = WorkerHealth(o, self.metrics)
        self.prompts = PromptIds(tokenizers or {}, o)
        self.inflight = 0
        #: Requests waiting for a slot (queue_timeout_s), first in line first.
        self._waiting: deque[asyncio.Future[None]] = deque()
        self._per_worker: dict[int, int] = {}
        self._upstream: UpstreamPool | None = None
        self._limiter: anyio.CapacityLimiter | None = None
        self._created = int(time.time())
        self._serving_of: Sequence[WorkerEndpoint] | None = None
        self._serving_by_model: dict[str, tuple[WorkerEndpoint, ...]] = {}
        #: Each model's disaggregated plan (None: whole requests) or why it has none, kept as
        #: long as its workers.
        self._plans: dict[str, disagg.Plan | ApiError | None] = {}
        #: Done when the replica is ready; one for every request waiting for it.
        self._readiness: asyncio.Task[None] | None = None

    # -- running -------------------------------------------------------------------------

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """The upstream connection pool and the health probes, for the server's life."""
        o = self.options
        self._upstream = UpstreamPool(o.connect_timeout_s, o.read_timeout_s, o.upstream_connections)
        self._limiter = anyio.CapacityLimiter(ROUTE_THREADS)
        probes = asyncio.get_running_loop().create_task(
            probe_loop(self.directory, self.health, self._upstream, o)
        ) if o.health_interval_s > 0 else None
        try:
            yield
        finally:
            if probes is not None:
                probes.cancel()
            if self._readiness is not None:
                self._readiness.cancel()
            self._upstream.close()
            self._upstream = None

    @property
    def upstream(self) -> UpstreamPool:
        if self._upstream is None:
            raise RuntimeError("the gateway is not running (serve its app with its lifespan)")
        return self._upstream

    @property
    def limiter(self) -> anyio.CapacityLimiter:
        assert self._limiter is not None
        return self._limiter

    def mount(self, app: Starlette, tokens: Tokens) -> None:
        """Add the endpoints to ``app``; they accept the client scope of ``tokens``.
        Mount it before the app's body limits (``add_middleware`` nests the later one
        outside): the POST endpoints are served by :class:`GatewayRoutes` inside them."""
        self.tokens = tokens
        app.add_middleware(GatewayRoutes, gateway=self)
        for endpoint in Endpoint:
            # What a POST never reaches (GatewayRoutes serves it): the app's 405 for
            # other methods.
            app.router.add_route(endpoint.value, _Served(self, endpoint), methods=["POST"], include_in_schema=False)
        app.router.add_route("/v1/models", self.models, methods=["GET"], include_in_schema=False)
        app.router.add_route("/v1/models/{model:path}", self.models, methods=["GET"], include_in_schema=False)

    # -- the candidates --------------------------------------------------------------------

    def choosable(self, endpoints: Sequence[WorkerEndpoint], tried: Collection[int], model: str) -> list[WorkerEndpoint]:
        """The workers of ``endpoints`` a request may go to now; ApiError 503 when none
        is up, 429 when every one that is up is at its in-flight limit."""
        up = [ep for ep in endpoints if ep.worker_id not in tried and self.health.available(ep.worker_id)]
        if not up:
            raise unavailable(f"no worker serving {model!r} is up" + (" (the others failed)" if tried else ""),
                              self.options.retry_after_s)
        cap = self.options.max_inflight_per_worker
        if cap:
            per = self._per_worker
            up = [ep for ep in up if per.get(ep.worker_id, 0) < cap]
            if not up:
                raise overloaded(f"every worker serving {model!r} has {cap} requests in flight", self.options.retry_after_s)
        return up

    def engage(self, worker_id: int) -> None:
        self._per_worker[worker_id] = self._per_worker.get(worker_id, 0) + 1
        self.health.attempt(worker_id)
        self.metrics.of(self.metrics.selected, str(worker_id)).inc()

    def release(self, worker_id: int) -> None:
        self._per_worker[worker_id] -= 1

    # -- endpoints ---------------------------------------------------------------------------

    async def serve(self, endpoint: Endpoint, scope: dict, receive: Any, send: Any) -> None:
        """One request of ``endpoint``, as a plain ASGI app: Starlette's Request and
        FastAPI's machinery cost as much as the relay itself."""
        answer = await self._answer(endpoint, scope, receive)
        if answer is not None:
            await answer(scope, receive, send)

    async def _answer(self, endpoint: Endpoint, scope: dict, receive: Any) -> Response | Exchange | None:
        """The request's answer (None: the client left before its body was whole)."""
        started = time.perf_counter()
        given = authorization = None
        for k, v in scope["headers"]:  # the first of each, as Starlette's headers.get
            if k == b"x-request-id":
                given = v.decode("latin-1") if given is None else given
            elif k == b"authorization":
                authorization = v.decode("latin-1") if authorization is None else authorization
        request_id = given if given is not None and request_ids.is_safe(given) else request_ids.mint()
        known = ""  # the model label: only names the directory knows
        try:
            if not self.tokens.allows(authorization or "", (Scope.CLIENT,)):
                raise unauthorized("missing or wrong bearer token (the replica's client token is the api key)")
            await self._admit()
        except ApiError as exc:
            return self._refuse(exc, endpoint, known, request_id)
        try:
            raw = await _body(receive)
            if raw is None:
                self._left()
                return None
            req = parse(raw, endpoint)
            endpoints = self._serving(req.model)
            if not endpoints:
                raise unknown_model(req.model)
            known = req.model
            plan = self._plan(req.model, endpoints) if endpoint is not Endpoint.EMBEDDINGS else None
            if not self.replica.ready and not await self._ready_within(self.options.ready_wait_s):
                raise unavailable(f"the replica is not ready (catching up with the log; waited "
                                  f"{self.options.ready_wait_s:g}s)", self.options.retry_after_s)
            up = self.choosable(endpoints, (), req.model)
            if endpoint is Endpoint.EMBEDDINGS:
                ids: PromptTokens = []
            else:
                # The least loaded first (the one asked, when engines tokenize); the
                # others in case it cannot answer.
                by_load = sorted(up, key=lambda ep: self._per_worker.get(ep.worker_id, 0))
                ids, send_ids = await self.prompts.ids(req, len(raw), by_load, self.upstream)
                if len(ids) > self.options.max_prompt_tokens:
                    raise bad_request(
                        f"the prompt has {len(ids)} tokens, more than the {self.options.max_prompt_tokens} accepted",
                        "messages" if endpoint is Endpoint.CHAT else "prompt", "context_length_exceeded",
                    )
                if send_ids:  # the engine need not tokenize it again
                    req, raw = with_prompt_ids(req, ids)
        except ApiError as exc:
            self._left()
            return self._refuse(exc, endpoint, known, request_id)
        except BaseException:
            self._left()
            raise
        lora = req.model if any(req.model in ep.loras for ep in endpoints) else None
        return Exchange(self, req, raw, scope["headers"], request_id, ids, lora, endpoints, started, plan)

    async def _ready_within(self, timeout: float) -> bool:
        """Whether the replica is ready within ``timeout`` s: one task looks for every
        request waiting (a burst at a restart does not each poll)."""
        if timeout <= 0:
            return False
        if self._readiness is None:
            self._readiness = asyncio.get_running_loop().create_task(self._until_ready())
        try:
            await asyncio.wait_for(asyncio.shield(self._readiness), timeout)
        except TimeoutError:
            return False
        return True

    async def _until_ready(self) -> None:
        try:
            while not self.replica.ready:
                await asyncio.sleep(READY_POLL_S)
        finally:
            self._readiness = None

    def _serving(self, model: str) -> Sequence[WorkerEndpoint]:
        """The directory's workers serving ``model``, kept while the directory gives the
        same sequence of workers (an unchanged registry)."""
        workers = self.directory.endpoints()
        if workers is not self._serving_of:
            self._serving_of, self._serving_by_model, self._plans = workers, {}, {}
        found = self._serving_by_model.get(model)
        if found is None:
            found = self._serving_by_model[model] = tuple(ep for ep in workers if ep.serves(model))
        return found

    def _plan(self, model: str, endpoints: Sequence[WorkerEndpoint]) -> disagg.Plan | None:
        """The legs of ``model``'s requests (after :meth:`_serving`, whose workers it keeps)."""
        if model not in self._plans:
            try:
                self._plans[model] = disagg.plan(endpoints, model, self.options.retry_after_s)
            except ApiError as exc:
                self._plans[model] = exc
        found = self._plans[model]
        if isinstance(found, ApiError):
            raise found.with_traceback(None)  # one error kept: no traceback piling up on it
        return found

    async def models(self, request: Request) -> Response:
        """``GET /v1/models``, and ``/v1/models/{model}`` (404 for a name no worker serves)."""
        if not self.tokens.allows(request.headers.get("authorization", ""), (Scope.CLIENT,)):
            exc = unauthorized("missing or wrong bearer token (the replica's client token is the api key)")
            return Response(exc.body(), exc.status, media_type="application/json")
        names: dict[str, str | None] = {}
        for ep in self.directory.endpoints():
            for m in ep.models:
                names.setdefault(m, None)
            for lora in ep.loras:
                names.setdefault(lora, ep.models[0] if ep.models else None)
        data = {
            name: {"id": name, "object": "model", "created": self._created, "owned_by": "kvstream"}
            | ({"parent": parent} if parent else {})
            for name, parent in names.items()
        }
        one = request.path_params.get("model")
        if one is None:
            return Response(orjson.dumps({"object": "list", "data": list(data.values())}), media_type="application/json")
        if one not in data:
            exc = unknown_model(one)
            return Response(exc.body(), exc.status, media_type="application/json")
        return Response(orjson.dumps(data[one]), media_type="application/json")

    # -- the end of a request --------------------------------------------------------------

    async def _admit(self) -> None:
        """A slot among the ``max_inflight``: at once, or after waiting in line (FIFO) up
        to ``queue_timeout_s`` while at most ``max_queued`` wait; else 429."""
        o = self.options
        if self.inflight < o.max_inflight:
            self.inflight += 1
            self.metrics.inflight.inc()
            return
        if not o.queue_timeout_s or len(self._waiting) >= o.max_queued:
            raise overloaded(f"this replica relays {o.max_inflight} requests already", o.retry_after_s)
        turn = asyncio.get_running_loop().create_future()
        self._waiting.append(turn)
        self.metrics.queued.inc()
        try:
            await asyncio.wait_for(turn, o.queue_timeout_s)  # a slot handed over by _left
        except TimeoutError:
            raise overloaded(
                f"this replica relays {o.max_inflight} requests already; none ended within {o.queue_timeout_s}s",
                o.retry_after_s,
            ) from None
        finally:
            self.metrics.queued.dec()
            if turn in self._waiting:  # it gave up in line (timed out, or cancelled)
                self._waiting.remove(turn)

    def _left(self) -> None:
        while self._waiting:  # the slot passes to the first still waiting
            turn = self._waiting.popleft()
            if not turn.done():
                turn.set_result(None)
                return
        self.inflight -= 1
        self.metrics.inflight.dec()

    def _refuse(self, exc: ApiError, endpoint: Endpoint, model: str, request_id: str) -> Response:
        self.metrics.of(self.metrics.requests, model, endpoint.value, str(exc.status)).inc()
        return Response(exc.body(), exc.status, headers=exc.headers() | {"x-request-id": request_id},
                        media_type="application/json")

    def finished(self, ex: Exchange) -> None:
        """A relayed request ended (answered, failed or abandoned): its metrics and its log line."""
        self._left()
        m, model, endpoint = self.metrics, ex.req.model, ex.req.endpoint.value
        end = time.perf_counter()
        m.of(m.requests, model, endpoint, str(ex.status)).inc()
        m.of(m.e2e, model, endpoint).observe(end - ex.started)
        ttft = None if ex.first_at is None else ex.first_at - ex.started
        if ttft is not None:
            m.of(m.ttft, model).observe(ttft)
        usage = ex.usage
        # A disaggregated request's cache is its prefill's (the decode engine's count is
        # of the KV it was sent).
        cached_by = ex.prefill_usage if ex.plan is not None else usage
        details = cached_by.get("prompt_tokens_details") if cached_by else None
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        cached = cached if type(cached) is int and cached >= 0 else None
        prompt_tokens = usage.get("prompt_tokens") if usage else None
        prompt_tokens = prompt_tokens if type(prompt_tokens) is int and prompt_tokens >= 0 else len(ex.ids)
        if ex.status == 200 and ex.track:
            m.of(m.predicted_cached, model, "true" if cached is not None else "false").inc(ex.predicted)
            m.of(m.forgone_cached, model).inc(ex.forgone)
            m.of(m.prompt_tokens, model).inc(prompt_tokens)
            if cached is not None:
                m.of(m.engine_cached, model).inc(cached)
        log.info(
            "gateway request", request_id=ex.request_id, load_id=ex.life.request_id, model=model, endpoint=endpoint, worker=ex.tried_last,
            prefill_worker=ex.prefill_worker, attempts=ex.attempts, predicted_cached_tokens=ex.predicted, forgone_cached_tokens=ex.forgone,
            engine_cached_tokens=cached,
            prompt_tokens=prompt_tokens, ttft_ms=None if ttft is None else round(ttft * 1000, 3),
            e2e_ms=round((end - ex.started) * 1000, 3), status=ex.status, outcome=ex.outcome,
        )


async def _body(receive: Any) -> bytes | None:
    """The request's body (None when the client left before it was whole)."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


class _Served:
    """``Gateway.serve`` of one endpoint as an ASGI app."""

    __slots__ = ("endpoint", "gateway")

    def __init__(self, gateway: Gateway, endpoint: Endpoint) -> None:
        self.gateway, self.endpoint = gateway, endpoint

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        await self.gateway.serve(self.endpoint, scope, receive, send)


class GatewayRoutes:
    """ASGI middleware: a POST to one of the gateway's endpoints is served here, before
    the app's router and the middleware inside it (each of which wraps every chunk a
    stream sends); anything else goes on to the app."""

    def __init__(self, app: Any, gateway: Gateway) -> None:
        self.app = app
        self.routes = {endpoint.value: _Served(gateway, endpoint) for endpoint in Endpoint}

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and (served := self.routes.get(scope["path"])) is not None:
            await served(scope, receive, send)
        else:
            await self.app(scope, receive, send)
