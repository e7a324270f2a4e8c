"""The replica's HTTP API (DESIGN.md §9), JSON over FastAPI.

Every input is validated (FastAPI/pydantic answer 422 with the reason); router errors map
to 4xx (404 unknown request, 409 duplicate, 503 no eligible worker or not ready); the
service never crashes on input. Routing is refused with 503 until the replica is ready,
so nothing stale is served while it catches up.

Trust boundaries: endpoints need a bearer token of their scope (kvstream.replica.auth);
bodies are capped before parsing and routing runs off the event loop in a bounded pool of
threads (kvstream.replica.http_limits), so /healthz answers while a 1M-token prompt is
routed; request ids are a safe set, scoped per replica (kvstream.replica.request_ids);
/docs and /openapi.json exist only when asked for.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from array import array
from collections.abc import AsyncIterator, Mapping
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import asynccontextmanager
from multiprocessing import get_context
from typing import Annotated, Any, Literal, NamedTuple

import anyio
from fastapi import Depends, FastAPI, HTTPException, Path, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvstream.hashing import MmSpan
from kvstream.replica import request_ids
from kvstream.replica.auth import Scope, Tokens
from kvstream.replica.errors import SnapshotError
from kvstream.replica.http_limits import BodyLimit, HttpLimits
from kvstream.replica.peer import stream_snapshot
from kvstream.replica.replica import Replica
from kvstream.router.errors import (
    DuplicateRequestError,
    NoEligibleWorkerError,
    RouterError,
    SchedulerConfigError,
    UnknownRequestError,
)
from kvstream.router.explain import decision_dict
from kvstream.router.scheduler import SchedulerOverrides

#: Longest prompt accepted (tokens): bounds the work one request can ask for.
MAX_TOKENS = 1 << 20


class Weights(BaseModel):
    """Per-request overrides of the scheduler's weights and filters (§5)."""

    model_config = ConfigDict(extra="forbid")

    overlap_score_credit: float | None = Field(None, ge=0)
    host_cache_hit_weight: float | None = Field(None, ge=0)
    disk_cache_hit_weight: float | None = Field(None, ge=0)
    prefill_load_scale: float | None = Field(None, ge=0)
    decode_active_request_weight: float | None = Field(None, ge=0)
    router_temperature: float | None = Field(None, ge=0)
    max_active_decode_blocks: int | None = Field(None, ge=0)
    max_active_prefill_tokens: int | None = Field(None, ge=0)
    allowed_workers: list[Annotated[int, Field(ge=0, lt=1 << 64)]] | None = None


class MmSpanBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    hash: int = Field(..., ge=0, lt=1 << 64)
    offset: int = Field(..., ge=0)
    length: int = Field(..., ge=1)


class RouteRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    token_ids: list[Annotated[int, Field(ge=0, lt=1 << 32)]] = Field(..., max_length=MAX_TOKENS)
    request_id: str | None = Field(None, pattern=request_ids.PATTERN)
    lora_name: str | None = Field(None, max_length=256)
    #: Cache salt (Dynamo's cache_namespace): blocks are shared only under the same salt.
    cache_salt: str | None = Field(None, max_length=256)
    #: Multimodal objects in the prompt: their hashes enter the blocks they overlap.
    mm: list[MmSpanBody] = Field(default_factory=list, max_length=1024)
    query_only: bool = False
    weights: Weights | None = None
    #: The routing policy for this request (default: the replica's ``[router] policy``).
    policy: Literal["kv", "ttft"] | None = None
    #: Include every candidate's terms of worker_logit in the answer.
    explain: bool = False


class RouteQuery(BaseModel):
    """The fields of a binary route request (``application/octet-stream``: the body is
    the token ids as little-endian u32, validated in the compiled core), as query
    parameters. Per-request weights and multimodal spans need the JSON form."""

    model_config = ConfigDict(extra="forbid")

    request_id: str | None = Field(None, pattern=request_ids.PATTERN)
    lora_name: str | None = Field(None, max_length=256)
    cache_salt: str | None = Field(None, max_length=256)
    query_only: bool = False
    explain: bool = False
    policy: Literal["kv", "ttft"] | None = None


#: The binary body of a route request: little-endian u32 token ids.
BINARY_PROMPT = "application/octet-stream"


class BinaryRoute(NamedTuple):
    """A binary route request: its query fields and its body, still packed (the core
    checks it: whole u32s)."""

    query: RouteQuery
    tokens: bytes


def binary_route(raw: bytes, params: Mapping[str, str]) -> BinaryRoute:
    if len(raw) > 4 * MAX_TOKENS:
        raise HTTPException(413, f"prompt of {len(raw)} bytes exceeds {MAX_TOKENS} tokens")
    try:
        return BinaryRoute(RouteQuery.model_validate(dict(params)), raw)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from None


RequestId = Annotated[str, Path(pattern=request_ids.PATTERN)]

#: Route bodies at least this large are parsed in a child process: pydantic holds the GIL
#: while it parses (about 0.2–0.4 s for a 1M-token prompt), which would stall the event
#: loop whatever thread ran it. Smaller ones parse in the routing thread (~ms).
PARSE_APART_BYTES = 1 << 20


def parse_route(raw: bytes) -> RouteRequest:
    # Straight from the bytes (pydantic's JSON parser): a prompt is thousands of ints,
    # and FastAPI's json.loads + validation would cost several times more.
    try:
        return RouteRequest.model_validate_json(raw)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from None


def parse_apart(raw: bytes) -> tuple[bytes, dict[str, Any]] | list[dict[str, Any]]:
    """In a child process: the validated body with its token ids packed as u32 (so that no
    million Python ints cross back), or its validation errors (picklable parts only)."""
    try:
        body = RouteRequest.model_validate_json(raw)
    except ValidationError as exc:
        return [{"loc": e.get("loc"), "msg": e.get("msg"), "type": e.get("type")} for e in exc.errors()[:10]]
    return array("I", body.token_ids).tobytes(), body.model_dump(exclude={"token_ids"})


def unpack_parsed(parsed: tuple[bytes, dict[str, Any]] | list[dict[str, Any]]) -> RouteRequest:
    if isinstance(parsed, list):
        raise RequestValidationError(parsed)
    tokens, rest = parsed
    body = RouteRequest.model_validate(rest | {"token_ids": []})
    body.token_ids = array("I", tokens)  # type: ignore[assignment]  # validated in the child
    return body


def create_app(
    replica: Replica,
    token: str | None = None,
    *,
    tokens: Tokens | None = None,
    limits: HttpLimits | None = None,
    docs: bool = False,
) -> FastAPI:
    """The API of ``replica``. ``tokens`` by scope (or ``token`` for every scope; neither:
    open); ``docs`` serves /docs and /openapi.json."""
    tokens = tokens if tokens is not None else Tokens.build(token)
    limits = limits or HttpLimits()
    parsers: list[ProcessPoolExecutor] = []  # started on the first large body

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        for pool in parsers:
            pool.shutdown(cancel_futures=True)

    app = FastAPI(
        title="kvstream replica", version="1", lifespan=lifespan,
        docs_url="/docs" if docs else None, redoc_url=None, openapi_url="/openapi.json" if docs else None,
    )
    metrics = replica.metrics
    app.add_middleware(BodyLimit, limits=limits, on_reject=lambda limit: metrics.http_rejected.labels(limit=limit).inc())
    routing: list[anyio.CapacityLimiter] = []  # made on first use, inside the event loop
    streaming = [0]  # /v1/snapshot streams running

    def needs(*scopes: Scope) -> list:
        async def check(request: Request) -> None:
            if not tokens.allows(request.headers.get("authorization", ""), scopes):
                raise HTTPException(401, f"missing or wrong bearer token (scope: {' or '.join(scopes)})")

        return [Depends(check)]

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        metrics.http_errors.labels(status="422").inc()
        errors = [{"loc": e.get("loc"), "msg": e.get("msg")} for e in exc.errors()[:10]]
        return JSONResponse({"error": "invalid request", "details": errors}, status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        metrics.http_errors.labels(status=str(exc.status_code)).inc()
        return JSONResponse({"error": exc.detail}, status_code=exc.status_code)

    def route_sync(raw: bytes | RouteRequest | BinaryRoute) -> dict[str, Any]:
        if isinstance(raw, BinaryRoute):
            body: RouteRequest | RouteQuery = raw.query
            tokens: Any = raw.tokens
            spans: list[MmSpan] = []
        else:
            body = raw if isinstance(raw, RouteRequest) else parse_route(raw)
            tokens = body.token_ids
            spans = [MmSpan(m.hash, m.offset, m.length) for m in body.mm]
        if not replica.ready:
            raise HTTPException(503, "replica is not ready (catching up with the log)")
        overrides = None
        if isinstance(body, RouteRequest) and body.weights is not None:
            w = body.weights.model_dump()
            if w["allowed_workers"] is not None:
                w["allowed_workers"] = frozenset(w["allowed_workers"])
            overrides = SchedulerOverrides(**w)
        if body.policy is not None:
            overrides = dataclasses.replace(overrides or SchedulerOverrides(), policy=body.policy)
        t0 = time.perf_counter()
        try:
            decision = replica.route(
                tokens, body.lora_name, body.request_id, body.query_only, overrides,
                cache_salt=body.cache_salt, mm=spans,
            )
        except NoEligibleWorkerError as exc:
            raise HTTPException(503, str(exc)) from None
        except DuplicateRequestError as exc:
            raise HTTPException(409, str(exc)) from None
        except (SchedulerConfigError, ValueError) as exc:
            raise HTTPException(400, str(exc)) from None
        metrics.route_latency.observe(time.perf_counter() - t0)
        return decision_dict(decision, body.explain)

    @app.post("/v1/route", dependencies=needs(Scope.CLIENT))
    async def route(request: Request) -> dict[str, Any]:
        # Parsing and routing a long prompt take long (up to 1–2 s at 1M tokens): off the
        # event loop, in a bounded pool of threads (and processes for large bodies), so
        # that it keeps serving (/healthz).
        raw: bytes | RouteRequest | BinaryRoute = await request.body()
        if not routing:
            routing.append(anyio.CapacityLimiter(limits.route_threads))
        if request.headers.get("content-type", "").split(";")[0].strip() == BINARY_PROMPT:
            # Nothing to parse: the core reads the packed ids (with the GIL released
            # while it routes them).
            raw = binary_route(raw, request.query_params)  # type: ignore[arg-type]
        elif len(raw) >= PARSE_APART_BYTES:  # type: ignore[arg-type]
            if not parsers:
                parsers.append(ProcessPoolExecutor(limits.route_threads, mp_context=get_context("spawn")))
            async with routing[0]:
                try:
                    parsed = await asyncio.get_running_loop().run_in_executor(parsers[0], parse_apart, raw)
                except BrokenProcessPool:  # a parser died (e.g. killed for memory): a new pool
                    parsers.pop().shutdown(wait=False)
                    raise HTTPException(503, "the request parser failed; retry") from None
            raw = unpack_parsed(parsed)
        return await anyio.to_thread.run_sync(route_sync, raw, limiter=routing[0])

    @app.post("/v1/requests/{request_id}/prefill_done", dependencies=needs(Scope.CLIENT))
    def prefill_done(request_id: RequestId) -> dict[str, str]:
        try:
            replica.prefill_done(request_id)
        except UnknownRequestError as exc:
            raise HTTPException(404, str(exc)) from None
        except RouterError as exc:
            raise HTTPException(409, str(exc)) from None
        return {"request_id": request_id, "state": "decoding"}

    @app.delete("/v1/requests/{request_id}", dependencies=needs(Scope.CLIENT))
    def free(request_id: RequestId) -> dict[str, str]:
        try:
            replica.free(request_id)
        except UnknownRequestError as exc:
            raise HTTPException(404, str(exc)) from None
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
        body = {"ready": replica.ready, "lag": replica.lag(), "replica_id": replica.replica_id,
                "reasons": replica.not_ready_reasons()}
        return JSONResponse(body, status_code=200 if replica.ready else 503)

    @app.get("/metrics")
    def prometheus() -> Response:
        with replica.lock:
            metrics.set_rejections(dict(replica.fold.counters) | dict(replica.router.index.counters))
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
