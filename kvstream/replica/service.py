"""The replica's HTTP API (DESIGN.md §9), JSON over FastAPI.

Every input is validated (FastAPI/pydantic answer 422 with the reason); router errors map
to 4xx (404 unknown request, 409 duplicate, 503 no eligible worker or not ready); the
service never crashes on input. Routing is refused with 503 until the replica is ready,
so nothing stale is served while it catches up.
"""

from __future__ import annotations

import hmac
import time
from typing import Annotated, Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvstream.hashing import MmSpan
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
    request_id: str | None = Field(None, min_length=1, max_length=256)
    lora_name: str | None = Field(None, max_length=256)
    #: Cache salt (Dynamo's cache_namespace): blocks are shared only under the same salt.
    cache_salt: str | None = Field(None, max_length=256)
    #: Multimodal objects in the prompt: their hashes enter the blocks they overlap.
    mm: list[MmSpanBody] = Field(default_factory=list, max_length=1024)
    query_only: bool = False
    weights: Weights | None = None
    #: Include every candidate's terms of worker_logit in the answer.
    explain: bool = False


def create_app(replica: Replica, token: str | None = None) -> FastAPI:
    app = FastAPI(title="kvstream replica", version="1")
    metrics = replica.metrics

    async def check_token(request: Request) -> None:
        if token is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            raise HTTPException(401, "missing or wrong bearer token")

    auth = [Depends(check_token)]

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        metrics.http_errors.labels(status="422").inc()
        errors = [{"loc": e.get("loc"), "msg": e.get("msg")} for e in exc.errors()[:10]]
        return JSONResponse({"error": "invalid request", "details": errors}, status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        metrics.http_errors.labels(status=str(exc.status_code)).inc()
        return JSONResponse({"error": exc.detail}, status_code=exc.status_code)

    @app.post("/v1/route", dependencies=auth)
    async def route(request: Request) -> dict[str, Any]:
        # Parsed straight from the bytes (pydantic's JSON parser): a prompt is thousands
        # of ints, and FastAPI's json.loads + validation would cost several times more.
        # Async: no thread-pool hop; the decision itself is CPU-bound under the lock anyway.
        try:
            body = RouteRequest.model_validate_json(await request.body())
        except ValidationError as exc:
            raise RequestValidationError(exc.errors()) from None
        if not replica.ready:
            raise HTTPException(503, "replica is not ready (catching up with the log)")
        overrides = None
        if body.weights is not None:
            w = body.weights.model_dump()
            if w["allowed_workers"] is not None:
                w["allowed_workers"] = frozenset(w["allowed_workers"])
            overrides = SchedulerOverrides(**w)
        t0 = time.perf_counter()
        try:
            decision = replica.route(
                body.token_ids, body.lora_name, body.request_id, body.query_only, overrides,
                cache_salt=body.cache_salt, mm=[MmSpan(m.hash, m.offset, m.length) for m in body.mm],
            )
        except NoEligibleWorkerError as exc:
            raise HTTPException(503, str(exc)) from None
        except DuplicateRequestError as exc:
            raise HTTPException(409, str(exc)) from None
        except (SchedulerConfigError, ValueError) as exc:
            raise HTTPException(400, str(exc)) from None
        metrics.route_latency.observe(time.perf_counter() - t0)
        return decision_dict(decision, body.explain)

    @app.post("/v1/requests/{request_id}/prefill_done", dependencies=auth)
    def prefill_done(request_id: str) -> dict[str, str]:
        try:
            replica.prefill_done(request_id)
        except UnknownRequestError as exc:
            raise HTTPException(404, str(exc)) from None
        except RouterError as exc:
            raise HTTPException(409, str(exc)) from None
        return {"request_id": request_id, "state": "decoding"}

    @app.delete("/v1/requests/{request_id}", dependencies=auth)
    def free(request_id: str) -> dict[str, str]:
        try:
            replica.free(request_id)
        except UnknownRequestError as exc:
            raise HTTPException(404, str(exc)) from None
        return {"request_id": request_id, "state": "freed"}

    @app.get("/v1/workers", dependencies=auth)
    def workers() -> dict[str, Any]:
        return replica.workers_view()

    @app.get("/v1/snapshot", dependencies=auth)
    def snapshot() -> Response:
        if replica.store is None:
            raise HTTPException(404, "this replica keeps no snapshots (no --snapshot-dir)")
        return StreamingResponse(stream_snapshot(replica.store), media_type="application/octet-stream")

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
