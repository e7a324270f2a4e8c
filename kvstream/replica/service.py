"""The replica's HTTP API (DESIGN.md §9): JSON, and binary route bodies, over FastAPI.

Every input is validated (422 with where and why: kvstream.replica.route_body for route
requests, FastAPI for the other endpoints); router errors map to 4xx (404 unknown
request, 409 duplicate, 503 no eligible worker or not ready); the service never crashes
on input. Routing is refused with 503 until the replica is ready, so nothing stale is
served while it catches up.

Trust boundaries: endpoints need a bearer token of their scope (kvstream.replica.auth);
bodies are capped before parsing (kvstream.replica.http_limits); large route requests are
parsed and routed off the event loop in a bounded pool of threads, so /healthz answers
while a 1M-token prompt is routed; request ids are a safe set, scoped per replica
(kvstream.replica.request_ids); /docs and /openapi.json exist only when asked for.
"""

from __future__ import annotations

import asyncio
import time
from array import array
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from multiprocessing import get_context
from typing import Annotated, Any, Protocol, TypeVar

import anyio
import msgspec
import orjson
from fastapi import Depends, FastAPI, HTTPException, Path, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvstream.hashing import MmSpan
from kvstream.replica import request_ids, route_body
from kvstream.replica.auth import Scope, Tokens
from kvstream.replica.errors import AmbiguousRequestError, SnapshotError
from kvstream.replica.http_limits import BodyLimit, HttpLimits
from kvstream.replica.peer import stream_snapshot
from kvstream.replica.replica import Replica
from kvstream.replica.route_body import MAX_TOKENS, InvalidRequest, RouteQuery, RouteRequest
from kvstream.router.errors import (
    DuplicateRequestError,
    NoEligibleWorkerError,
    RouterError,
    SchedulerConfigError,
    UnknownRequestError,
)
from kvstream.router.explain import decision_dict

RequestId = Annotated[str, Path(pattern=request_ids.PATTERN)]

#: The binary body of a route request: little-endian u32 token ids.
BINARY_PROMPT = "application/octet-stream"

#: JSON route bodies at least this large are parsed in a child process: the decoder holds
#: the GIL while it runs (about 50 ms for a 1M-token prompt), which would stall the event
#: loop whatever thread ran it.
PARSE_APART_BYTES = 1 << 20

#: A route request: its fields, and its token ids (a list from JSON, or packed u32s).
Parsed = tuple[RouteQuery, list[int] | bytes]


#: Why a route names neither a request id nor query_only: the caller would place a request
#: whose load nobody counts (and that no prefill_done or DELETE can name).
UNCOUNTED = (
    "a route needs a request_id (the request's load is counted on every replica until its DELETE, "
    "or request_ttl_s) or query_only: true (a question: no load is added)"
)


_Fields = TypeVar("_Fields", bound=RouteQuery)


def counted(fields: _Fields) -> _Fields:
    """``fields``, when they say how the route counts; InvalidRequest otherwise."""
    if fields.request_id is None and not fields.query_only:
        raise InvalidRequest([{"loc": "$.request_id", "msg": UNCOUNTED}])
    return fields


def binary_route(raw: bytes, params: Iterable[tuple[str, str]]) -> Parsed:
    """A binary route request: its query fields, and its body still packed (the core
    checks it: whole u32s)."""
    if len(raw) > 4 * MAX_TOKENS:
        raise HTTPException(413, f"prompt of {len(raw)} bytes exceeds {MAX_TOKENS} tokens")
    return counted(route_body.from_query(params)), raw


def json_route(raw: bytes) -> Parsed:
    body = counted(route_body.from_json(raw))
    return body, body.token_ids


def parse_apart(raw: bytes) -> tuple[RouteRequest, bytes] | list[dict[str, str]]:
    """In a child process: the validated body, with its token ids packed as u32 (so that
    no million Python ints cross back), or why it is invalid."""
    try:
        body = counted(route_body.from_json(raw))
    except InvalidRequest as exc:
        return exc.details
    return msgspec.structs.replace(body, token_ids=[]), array("I", body.token_ids).tobytes()


def unpack_parsed(parsed: tuple[RouteRequest, bytes] | list[dict[str, str]]) -> Parsed:
    if isinstance(parsed, list):
        raise InvalidRequest(parsed)
    return parsed


def _with_route_schema(app: FastAPI) -> dict[str, Any]:
    """The app's OpenAPI schema with ``POST /v1/route``, a plain Starlette route that FastAPI
    does not describe: its bodies' schema from route_body's structs."""
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    (body, _), components = msgspec.json.schema_components(
        [RouteRequest, RouteQuery], ref_template="#/components/schemas/{name}"
    )
    schema.setdefault("components", {}).setdefault("schemas", {}).update(components)
    query = components["RouteQuery"]["properties"]
    schema["paths"]["/v1/route"] = {"post": {
        "summary": "Route a request",
        "description": "A JSON body, or the token ids as little-endian u32 (application/octet-stream) "
        "with the other fields as query parameters (binary bodies only).",
        "parameters": [{"name": k, "in": "query", "required": False, "schema": v} for k, v in query.items()],
        "requestBody": {"required": True, "content": {
            "application/json": {"schema": body},
            BINARY_PROMPT: {"schema": {"type": "string", "format": "binary"}},
        }},
        "responses": {"200": {"description": "The chosen worker"}, "422": {"description": "Invalid request"}},
    }}
    app.openapi_schema = schema
    return schema


class Endpoints(Protocol):
    """More endpoints on the replica's app, served in its process (the OpenAI gateway,
    kvstream.gateway.app, which ``kvstream router`` composes: kvstream.serve)."""

    def mount(self, app: FastAPI, tokens: Tokens) -> None:
        """Add the endpoints; called before the body limits are added, so that they
        apply to them too."""
        ...

    def running(self) -> AbstractAsyncContextManager[None]:
        """What the endpoints need while the app serves (its lifespan)."""
        ...


def create_app(
    replica: Replica,
    token: str | None = None,
    *,
    tokens: Tokens | None = None,
    limits: HttpLimits | None = None,
    docs: bool = False,
    gateway: Endpoints | None = None,
) -> FastAPI:
    """The API of ``replica``. ``tokens`` by scope (or ``token`` for every scope; neither:
    open); ``docs`` serves /docs and /openapi.json; ``gateway`` adds the OpenAI endpoints
    (kvstream.gateway.app), running for the app's lifespan."""
    tokens = tokens if tokens is not None else Tokens.build(token)
    limits = limits or HttpLimits()
    parsers: list[ProcessPoolExecutor] = []  # started on the first large body

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if gateway is None:
            yield
        else:
            async with gateway.running():
                yield
        for pool in parsers:
            pool.shutdown(cancel_futures=True)

    app = FastAPI(
        title="kvstream replica", version="1", lifespan=lifespan,
        # /docs and /openapi.json, when asked for, are operator endpoints (below).
        docs_url=None, redoc_url=None, openapi_url=None,
        # The replica reports by Prometheus metrics and its own logs; FastAPI's OpenTelemetry
        # hooks would look for a provider on every request (a tenth of a route's cost).
        telemetry={"tracing": False, "metrics": False, "logs": False},
    )
    metrics = replica.metrics
    if gateway is not None:  # first: its endpoints are served inside the body limits
        gateway.mount(app, tokens)
    app.add_middleware(BodyLimit, limits=limits, on_reject=lambda limit: metrics.http_rejected.labels(limit=limit).inc())
    routing: list[anyio.CapacityLimiter] = []  # made on first use, inside the event loop
    streaming = [0]  # /v1/snapshot streams running

    def authorize(request: Request, scopes: tuple[Scope, ...]) -> None:
        if not tokens.allows(request.headers.get("authorization", ""), scopes):
            raise HTTPException(401, f"missing or wrong bearer token (scope: {' or '.join(scopes)})")

    def needs(*scopes: Scope) -> list:
        async def check(request: Request) -> None:
            authorize(request, scopes)

        return [Depends(check)]

    def invalid_request(details: Sequence[Mapping[str, Any]]) -> JSONResponse:
        metrics.http_errors.labels(status="422").inc()
        errors = [{"loc": e.get("loc"), "msg": e.get("msg")} for e in details[:10]]
        return JSONResponse({"error": "invalid request", "details": errors}, status_code=422)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return invalid_request(exc.errors())

    @app.exception_handler(InvalidRequest)
    async def invalid_route(_: Request, exc: InvalidRequest) -> JSONResponse:
        return invalid_request(exc.details)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        metrics.http_errors.labels(status=str(exc.status_code)).inc()
        return JSONResponse({"error": exc.detail}, status_code=exc.status_code)

    def decide(parsed: Parsed) -> bytes:
        """Route a parsed request; the answer as JSON."""
        fields, token_ids = parsed
        if not replica.ready:
            raise HTTPException(503, "replica is not ready (catching up with the log)")
        spans = [MmSpan(m.hash, m.offset, m.length) for m in fields.mm] if isinstance(fields, RouteRequest) else []
        t0 = time.perf_counter()
        try:
            decision = replica.route(
                token_ids, fields.lora_name, fields.request_id, fields.query_only, route_body.overrides(fields),
                cache_salt=fields.cache_salt, mm=spans,
            )
        except NoEligibleWorkerError as exc:
            raise HTTPException(503, str(exc)) from None
        except DuplicateRequestError as exc:
            raise HTTPException(409, str(exc)) from None
        except (SchedulerConfigError, ValueError) as exc:
            raise HTTPException(400, str(exc)) from None
        metrics.route_latency.observe(time.perf_counter() - t0)
        body = decision_dict(decision, fields.explain)
        if (stale := replica.staleness()) is not None:
            metrics.stale_decisions.inc()
            body["stale"] = stale
        return orjson.dumps(body)

    def route_threads() -> anyio.CapacityLimiter:
        if not routing:
            routing.append(anyio.CapacityLimiter(limits.route_threads))
        return routing[0]

    async def parse_in_child(raw: bytes) -> Parsed:
        if not parsers:
            parsers.append(ProcessPoolExecutor(limits.route_threads, mp_context=get_context("spawn")))
        async with route_threads():
            try:
                parsed = await asyncio.get_running_loop().run_in_executor(parsers[0], parse_apart, raw)
            except BrokenProcessPool:  # a parser died (e.g. killed for memory): a new pool
                parsers.pop().shutdown(wait=False)
                raise HTTPException(503, "the request parser failed; retry") from None
        return unpack_parsed(parsed)

    async def route(request: Request) -> Response:
        # A plain Starlette endpoint, not a FastAPI one: dependency solving and response
        # validation would cost several times the decision. A small request is parsed
        # and decided on the event loop (a thread hop costs more than the decision); a
        # large one off it, in a bounded pool of threads (and processes for large JSON
        # bodies), so that the loop keeps serving (/healthz) while a 1M-token prompt is
        # parsed and routed.
        authorize(request, (Scope.CLIENT,))
        raw = await request.body()
        small = len(raw) <= limits.inline_route_bytes
        if request.headers.get("content-type", "").split(";")[0].strip() == BINARY_PROMPT:
            # Nothing to parse: the core reads the packed ids (with the GIL released
            # while it routes them).
            parsed = binary_route(raw, request.query_params.multi_items())
        elif small:
            parsed = json_route(raw)
        elif len(raw) < PARSE_APART_BYTES:
            parsed = await anyio.to_thread.run_sync(json_route, raw, limiter=route_threads())
        else:
            parsed = await parse_in_child(raw)
        # Inline while the replica's lock is free or held briefly: when a snapshot holds
        # it, a routing thread waits for it, not the event loop.
        answer = await replica.loop_lock.run(decide, parsed, inline=small, limiter=route_threads())
        return Response(answer, media_type="application/json")

    app.router.add_route("/v1/route", route, methods=["POST"], include_in_schema=False)
    if docs:
        app.openapi = lambda: app.openapi_schema or _with_route_schema(app)  # type: ignore[method-assign]

        @app.get("/openapi.json", include_in_schema=False, dependencies=needs(Scope.OPERATOR))
        def openapi() -> JSONResponse:
            return JSONResponse(app.openapi())

        @app.get("/docs", include_in_schema=False, dependencies=needs(Scope.OPERATOR))
        def swagger() -> Response:
            return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{app.title} API")

    @app.post("/v1/requests/{request_id}/prefill_done", dependencies=needs(Scope.CLIENT))
    def prefill_done(request_id: RequestId) -> dict[str, str]:
        try:
            replica.prefill_done(request_id)
        except UnknownRequestError as exc:
            raise HTTPException(404, str(exc)) from None
        except (RouterError, AmbiguousRequestError) as exc:
            raise HTTPException(409, str(exc)) from None
        return {"request_id": request_id, "state": "decoding"}

    @app.delete("/v1/requests/{request_id}", dependencies=needs(Scope.CLIENT))
    def free(request_id: RequestId, refuted: bool = False) -> dict[str, str]:
        """The request ended; ``?refuted=true``: before its first token (it failed or was
        cancelled), so its prompt's blocks are no longer expected on its worker."""
        try:
            replica.free(request_id, refuted)
        except UnknownRequestError as exc:
            raise HTTPException(404, str(exc)) from None
        except AmbiguousRequestError as exc:
            raise HTTPException(409, str(exc)) from None
        return {"request_id": request_id, "state": "freed"}

    @app.get("/v1/workers", dependencies=needs(Scope.OPERATOR))
    def workers() -> dict[str, Any]:
        return replica.workers_view()

    @app.get("/v1/snapshot", dependencies=needs(Scope.OPERATOR, Scope.PEER))
    async def snapshot() -> Response:
        store = replica.store
        if store is None:
            raise HTTPException(404, "this replica keeps no snapshots (no --snapshot-dir)")
        if streaming[0] >= limits.snapshot_streams:
            metrics.http_rejected.labels(limit="busy").inc()
            raise HTTPException(503, f"{limits.snapshot_streams} snapshot streams are running; retry later")
        streaming[0] += 1  # the event loop's thread only: no lock needed
        frames = stream_snapshot(store)

        async def body():
            # Chunk by chunk, each read in a thread; a slow reader holds one chunk, as
            # the server waits for the socket to drain before the next.
            try:
                yield await anyio.to_thread.run_sync(next, frames)  # the meta
                while (chunk := await anyio.to_thread.run_sync(next, frames, None)) is not None:
                    yield chunk
            finally:
                streaming[0] -= 1

        stream = body()
        try:
            # Started here, so that its finally runs however the response ends (asyncio
            # closes a started generator that is dropped), and a missing snapshot is a 503.
            first = await stream.__anext__()
        except SnapshotError as exc:
            raise HTTPException(503, f"no snapshot to serve: {exc}") from None

        async def whole():
            yield first
            async for chunk in stream:
                yield chunk

        return StreamingResponse(whole(), media_type="application/octet-stream")

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    def readyz() -> JSONResponse:
        stale = replica.staleness()
        reasons = replica.not_ready_reasons()
        if stale is not None and replica.ready:
            reasons.append(f"serving from a stale index: {stale}")
        body = {"ready": replica.ready, "lag": replica.lag(), "replica_id": replica.replica_id,
                "reasons": reasons, "stale": stale}
        return JSONResponse(body, status_code=200 if replica.ready else 503)

    @app.get("/metrics")
    def prometheus() -> Response:
        with replica.lock:
            metrics.set_rejections(replica.fold.rejections())
            metrics.expected_blocks.set(replica.router.expected_total())
            learned = replica.router.learned_rates()
        metrics.ttft_rate.set(learned.fleet or 0.0)
        metrics.ttft_error.set(learned.error)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
