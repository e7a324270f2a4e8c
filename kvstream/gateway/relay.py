"""One request carried to a worker and its answer carried back (an ASGI response).

The body goes upstream as the client sent it (bytes, never re-encoded); the client's
headers go with it except the hop-by-hop ones and its credential (the worker's own key
replaces it). A connect error, a timeout or a 5xx before the worker's first byte sends
the request to the next-best *different* worker (``retries`` at most); after the first
byte a failure ends the stream with an SSE error event. A stream is relayed chunk by
chunk as it arrives; only the chunks up to the first content token are parsed (for
``prefill_done``) and the last 64 KiB kept (for the final ``usage``). A client that
disconnects cancels the upstream request (its connection is closed) and frees the load.

A disaggregated request (kvstream.gateway.disagg) has a prefill leg besides: vLLM's goes
first (retried on another prefill worker), SGLang's goes with each decode attempt (a
failed prefill retries the pair); each leg adds and frees its own load on its worker.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import orjson

from kvstream.gateway import disagg
from kvstream.gateway.errors import (
    ApiError,
    UpstreamError,
    UpstreamTimeout,
    overloaded,
    upstream_failed,
)
from kvstream.gateway.lifecycle import RequestLife
from kvstream.gateway.request_body import Endpoint, OpenAIRequest
from kvstream.gateway.seams import WorkerEndpoint
from kvstream.gateway.upstream import Response
from kvstream.logs import get_logger
from kvstream.roles import Handoff
from kvstream.router.core import PromptTokens
from kvstream.router.errors import NoEligibleWorkerError
from kvstream.router.index import WorkerKey
from kvstream.router.router import RouteDecision

if TYPE_CHECKING:
    import anyio

    from kvstream.gateway.health import WorkerHealth
    from kvstream.gateway.metrics import GatewayMetrics
    from kvstream.gateway.options import GatewayOptions
    from kvstream.gateway.upstream import UpstreamPool
    from kvstream.replica.replica import Replica

log = get_logger(__name__)

#: Headers that describe one connection, not the request (RFC 9110 §7.6.1).
HOP_BY_HOP = frozenset({
    b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"proxy-connection",
    b"te", b"trailer", b"transfer-encoding", b"upgrade",
})
#: Also not forwarded: the client's credential, the framing (the upstream client sets
#: ``Host`` and ``Content-Length``), and what the gateway sets (the worker sends plain
#: bytes: the relay reads the first token and usage).
_NOT_FORWARDED = HOP_BY_HOP | {
    b"host", b"content-length", b"authorization", b"accept-encoding", b"x-request-id",
    b"expect",  # the body is already here: nothing to wait for
    b"x-data-parallel-rank",  # the router's to choose, not the client's
}
#: Not relayed back: framing (the server frames the response itself) and what it sets.
_NOT_RELAYED = HOP_BY_HOP | {b"content-length", b"date", b"server", b"x-request-id"}
_SSE = "text/event-stream"
_DONE = b"[DONE]"
_JSON = (b"content-type", b"application/json")
#: A request still running after this long (s) starts watching for its client's
#: disconnect: a task per request costs more than relaying a short one, and a client
#: that left sooner is seen then.
_WATCH_AFTER_S = 0.02
#: Bytes of a stream's end kept for its ``usage`` (the last event before ``[DONE]``: under
#: 1 KiB from vLLM and SGLang).
_TAIL = 16 * 1024


def upstream_headers(
    client: Sequence[tuple[bytes, bytes]], request_id: str, api_key: str | None, dp_rank: int | None
) -> list[tuple[bytes, bytes]]:
    """The headers sent to the worker for a client's headers; ``dp_rank``: the rank the
    request is routed to, for an engine with several (vLLM and SGLang honour
    ``X-Data-Parallel-Rank``)."""
    named = {v.strip().lower() for k, v in client if k == b"connection" for v in v.split(b",")}
    out = [(k, v) for k, v in client if k not in _NOT_FORWARDED and k not in named] if named else \
        [(k, v) for k, v in client if k not in _NOT_FORWARDED]
    out += [(b"x-request-id", request_id.encode()), (b"accept-encoding", b"identity")]
    if dp_rank is not None:
        out.append((b"x-data-parallel-rank", b"%d" % dp_rank))
    if not any(k == b"content-type" for k, _ in client):
        out.append(_JSON)
    if api_key:
        out.append((b"authorization", b"Bearer " + api_key.encode()))
    return out


def _has_content(event: bytes) -> bool:
    """Whether one SSE event carries the first output: a token of text, content,
    reasoning or a tool call, or the end of a choice (a request that generates nothing
    has finished its prefill too)."""
    if not event.startswith(b"data:"):
        return False
    data = event[5:].strip()
    if data == _DONE:
        return True
    try:
        chunk = orjson.loads(data)
    except orjson.JSONDecodeError:
        return False
    for choice in chunk.get("choices") or () if isinstance(chunk, dict) else ():
        if not isinstance(choice, dict):
            continue
        if choice.get("text") or choice.get("finish_reason"):
            return True
        delta = choice.get("delta")
        if isinstance(delta, dict) and (
            delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning") or delta.get("tool_calls")
        ):
            return True
    return False


def _content_in(data: bytes) -> bytes | None:
    """None when one of the whole events of ``data`` carries content, else the part
    after its last whole event (events are read one by one up to the first with
    content: a read of a whole stream is not split into its events)."""
    if b"\r" in data:
        data = data.replace(b"\r\n", b"\n")
    start = 0
    while (end := data.find(b"\n\n", start)) >= 0:
        if _has_content(data[start:end]):
            return None
        start = end + 2
    return data[start:]


def stream_usage(tail: bytes) -> dict | None:
    """The ``usage`` of a stream's last bytes (``stream_options.include_usage``): that of
    the last event naming one, searched from the end (a stream's is its last event before
    ``[DONE]``: one search of the last bytes, however long the stream); the first event
    of ``tail`` may be cut (then it does not parse)."""
    end = len(tail)
    while (at := tail.rfind(b'"usage"', 0, end)) >= 0:
        # The event's line starts after the last newline before it (JSON holds none raw).
        line = tail.rfind(b"\n", 0, at) + 1
        if tail.startswith(b"data:", line):
            stop = tail.find(b"\n", at)
            try:
                usage = orjson.loads(tail[line + 5:stop if stop >= 0 else len(tail)]).get("usage")
            except (orjson.JSONDecodeError, AttributeError):  # the cut first event, or not an object
                usage = None
            if isinstance(usage, dict):
                return usage
        end = line
    return None


class _Tail:
    """A stream's last ``limit`` bytes or a little more, kept as the chunks that came (a
    copy of the tail per chunk would cost a stream of small events its length squared)."""

    __slots__ = ("_chunks", "_size", "limit")

    def __init__(self, limit: int) -> None:
        self._chunks: deque[bytes] = deque()
        self._size, self.limit = 0, limit

    def add(self, chunk: bytes) -> None:
        self._chunks.append(chunk)
        self._size += len(chunk)
        while self._size - len(self._chunks[0]) >= self.limit:
            self._size -= len(self._chunks.popleft())

    def __bytes__(self) -> bytes:
        return b"".join(self._chunks)


def body_usage(body: bytes) -> dict | None:
    try:
        usage = orjson.loads(body).get("usage")
    except (orjson.JSONDecodeError, AttributeError):
        return None
    return usage if isinstance(usage, dict) else None


def _count(usage: dict | None, *path: str) -> int | None:
    for key in path:
        if not isinstance(usage, dict):
            return None
        usage = usage.get(key)
    return usage if type(usage) is int and usage >= 0 else None


class _Upstream(Exception):
    """An attempt that failed before the worker's first byte (retried elsewhere)."""

    def __init__(self, worker: int, reason: str, error: ApiError, answer: tuple[int, list, bytes] | None = None) -> None:
        super().__init__(error.message)
        self.worker, self.reason, self.error, self.answer = worker, reason, error, answer


class Relaying(Protocol):
    """What an exchange needs of the gateway that relays it (kvstream.gateway.app.Gateway):
    the seam that keeps the relay from importing the app that composes it."""

    replica: Replica
    options: GatewayOptions
    health: WorkerHealth
    metrics: GatewayMetrics

    @property
    def upstream(self) -> UpstreamPool: ...

    @property
    def limiter(self) -> anyio.CapacityLimiter: ...

    def choosable(self, endpoints: Sequence[WorkerEndpoint], tried: Collection[int], model: str) -> list[WorkerEndpoint]: ...

    def engage(self, worker_id: int) -> None: ...

    def release(self, worker_id: int) -> None: ...

    def finished(self, ex: Exchange) -> None: ...


class Exchange:
    """The ASGI response of one relayed request."""

    def __init__(
        self,
        gateway: Relaying,
        req: OpenAIRequest,
        raw: bytes,
        headers: Sequence[tuple[bytes, bytes]],
        request_id: str,
        ids: PromptTokens,
        lora: str | None,
        endpoints: Sequence[WorkerEndpoint],
        started: float,
        plan: disagg.Plan | None = None,
    ) -> None:
        self.gw, self.req, self.raw, self.headers, self.request_id = gateway, req, raw, headers, request_id
        self.ids, self.lora, self.started = ids, lora, started
        self.track = req.endpoint is not Endpoint.EMBEDDINGS
        legs = disagg.LEG_SCHEDULING if plan is not None else None
        self.life = RequestLife(gateway.replica, gateway.limiter, timed=plan is None, overrides=legs)
        #: A disaggregated request's legs: the decode leg is the one relayed (``endpoints``).
        self.plan = plan
        self.endpoints = plan.decode if plan is not None else endpoints
        self.prefill_life = RequestLife(gateway.replica, gateway.limiter, overrides=legs) if plan is not None else None
        #: The prefill worker of the last prefill leg, and those that failed one.
        self.prefill_worker: int | None = None
        self.prefill_tried: set[int] = set()
        #: SGLang's prefill leg, running beside the decode leg.
        self.prefill_task: asyncio.Task | None = None
        #: The ``usage`` of the prefill leg's answer (its engine's cached tokens).
        self.prefill_usage: dict | None = None
        self.status = 0
        self.outcome = "ok"
        #: The worker holding the request now (engaged: released at the end).
        self.worker: int | None = None
        #: The last worker tried: the one the answer names.
        self.tried_last: int | None = None
        self.predicted = 0
        #: Cached tokens credited on another candidate beyond the chosen one's.
        self.forgone = 0
        self.attempts = 0
        self.first_at: float | None = None
        self.usage: dict | None = None
        self.disconnected = False
        self.finished = False
        self.response: Response | None = None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        task = asyncio.current_task()
        assert task is not None

        async def watch() -> None:
            # The server says http.disconnect when the client leaves (and once the
            # response is complete: ``finished`` is set before that).
            while (await receive())["type"] != "http.disconnect":
                pass
            if not self.finished:
                self.disconnected = True
                task.cancel()

        loop = asyncio.get_running_loop()
        watching: list[asyncio.Task] = []
        start_watching = loop.call_later(_WATCH_AFTER_S, lambda: watching.append(loop.create_task(watch())))
        try:
            try:
                await self._run(send)
            except ApiError as exc:
                if self.status:  # the answer had begun: it ends as it is
                    raise
                self.outcome = self.outcome if self.outcome != "ok" else exc.code or "error"
                self.finished = True
                await self._error(send, exc)
        except asyncio.CancelledError:
            if not self.disconnected:
                raise
            task.uncancel()
            self.outcome, self.status = "client_disconnected", 499  # nginx's code for it
        finally:
            self.finished = True
            start_watching.cancel()
            for watcher in watching:
                watcher.cancel()
            await self._end()

    async def _end(self) -> None:
        if self.response is not None:
            self.response.close()  # a relay cut short: the worker sees its client leave
        if self.prefill_task is not None:
            await _settle(self.prefill_task)
        if self.worker is not None:
            self.gw.release(self.worker)
            if self.disconnected:
                self.gw.health.abandoned(self.worker)
        await self.life.free()
        self.gw.finished(self)

    async def _error(self, send: Any, exc: ApiError) -> None:
        self.status = exc.status
        body = exc.body()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"x-request-id", self.request_id.encode())]
        headers += [(k.encode(), v.encode()) for k, v in exc.headers().items()]
        await send({"type": "http.response.start", "status": exc.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    # -- attempts ----------------------------------------------------------------------

    async def _run(self, send: Any) -> None:
        gw = self.gw
        if self.plan is not None and self.plan.handoff is Handoff.NIXL:
            refused = await self._nixl_prefill()
            if refused is not None:  # the prefill worker refused the request itself: its answer is the client's
                status, headers, body = refused
                self.outcome = f"worker_{status}"
                await self._start(send, status, headers, len(body))
                await send({"type": "http.response.body", "body": body})
                return
        tried: set[int] = set()
        last: _Upstream | None = None
        for _ in range(1 + gw.options.retries):
            try:
                eps = gw.choosable(self.endpoints, tried, self.req.model)
            except ApiError:
                if last is None:
                    raise
                break  # no other worker to retry on: the last failure is the answer
            try:
                resp = await self._attempt(eps)
            except _Upstream as exc:
                last = exc
                if exc.worker == self.worker:  # not the pair's prefill leg (that one is counted where it failed)
                    tried.add(exc.worker)
                    self._failed(exc)
                if self.worker is not None:
                    gw.release(self.worker)
                    self.worker = None
                await self.life.free()
                continue
            gw.health.succeeded(self.worker)  # type: ignore[arg-type]
            self.response = resp  # closed by _end unless relayed to its end
            if resp.status == 200 and resp.content_type == _SSE:
                await self._relay_stream(resp, send)
            else:
                await self._relay_whole(resp, send)
            return
        assert last is not None
        self.outcome = f"upstream_{last.reason}"
        if last.answer is not None:  # the worker's own 5xx, as it said it
            status, headers, body = last.answer
            await self._start(send, status, headers, len(body))
            await send({"type": "http.response.body", "body": body})
        else:
            raise last.error

    def _failed(self, exc: _Upstream) -> None:
        self.gw.metrics.upstream_failures.labels(worker=str(exc.worker), reason=exc.reason).inc()
        self.gw.health.failed(exc.worker, exc.error.message)

    async def _choose(self, life: RequestLife, eps: Sequence[WorkerEndpoint]) -> tuple[WorkerEndpoint, RouteDecision]:
        """One of ``eps`` (engaged), the request's load added on it in ``life``."""
        candidates = [WorkerKey(ep.worker_id, r) for ep in eps for r in range(ep.dp_ranks)]
        try:
            decision = await life.route(self.ids, self.lora, candidates, self.track)
        except NoEligibleWorkerError as exc:  # every candidate over the router's busy limits
            raise overloaded(f"every worker of {self.req.model!r} is busy: {exc}", self.gw.options.retry_after_s) from None
        wid = decision.worker.worker_id
        self.gw.engage(wid)
        if life is (self.life if self.plan is None else self.prefill_life):
            # The prompt's cache is the prefill's: that leg's overlap is the request's.
            self.predicted = decision.op.overlap_tokens if decision.op is not None else 0
            cached = decision.schedule.columns.cached_tokens
            self.forgone = int(cached.max() - cached[decision.schedule.chosen])
        return next(e for e in eps if e.worker_id == wid), decision

    async def _attempt(self, eps: Sequence[WorkerEndpoint]) -> Response:
        body, prefill = self.raw, None
        if self.plan is not None and self.plan.handoff is Handoff.BOOTSTRAP:
            p_ep, p_decision = await self._choose_prefill()
            body = disagg.bootstrap_body(self.req.body, p_ep)
            prefill = self.prefill_task = asyncio.create_task(self._prefill_leg(p_ep, p_decision, body))
        try:
            ep, decision = await self._choose(self.life, eps)
        except BaseException:
            if prefill is not None:
                await _settle(prefill)
            raise
        self.attempts += 1
        self.worker = self.tried_last = ep.worker_id
        if self.attempts > 1:
            self.gw.metrics.retries.labels(reason=self.outcome).inc()
        if prefill is None:
            return await self._post(ep, decision, body)
        decode = asyncio.ensure_future(self._post(ep, decision, body))
        try:
            await asyncio.wait((prefill, decode), return_when=asyncio.FIRST_COMPLETED)
            if not decode.done() or decode.exception() is not None:
                # A decode leg fails when its prefill does (no KV to meet): the pair is the
                # prefill's to answer for if that leg fails too, before it could have connected.
                await asyncio.wait((prefill,), timeout=self.gw.options.connect_timeout_s)
                if prefill.done() and prefill.exception() is not None:
                    raise prefill.exception()  # type: ignore[misc]  # the pair is retried elsewhere
            return await decode
        except BaseException:
            await _settle(decode)
            await _settle(prefill)
            raise

    async def _post(self, ep: WorkerEndpoint, decision: RouteDecision, body: bytes) -> Response:
        """``body`` sent to ``ep``: its answer once its head is whole; _Upstream when the
        worker cannot be reached, sends nothing in time or answers 5xx."""
        gw, wid = self.gw, ep.worker_id
        rank = decision.worker.dp_rank
        headers = upstream_headers(self.headers, self.request_id, ep.api_key, rank if rank or ep.dp_ranks > 1 else None)
        try:
            resp = await gw.upstream.request(ep.url, b"POST", self.req.endpoint.value.encode(), headers, body)
        except UpstreamTimeout:
            self.outcome = "timeout"
            raise _Upstream(wid, "timeout", upstream_failed(504, f"worker {wid} sent nothing within {gw.options.read_timeout_s}s")) from None
        except UpstreamError as exc:
            self.outcome = "connect"
            raise _Upstream(wid, "connect", upstream_failed(502, f"worker {wid} is unreachable: {exc}")) from None
        if resp.status >= 500:
            self.outcome = f"status_{resp.status}"
            try:
                answer = await resp.read()
            except UpstreamError:
                answer = b""
            finally:
                resp.close()
            raise _Upstream(
                wid, "5xx", upstream_failed(502, f"worker {wid} answered {resp.status}"), (resp.status, self._relayed(resp), answer)
            )
        return resp

    # -- the prefill leg ------------------------------------------------------------------

    async def _choose_prefill(self) -> tuple[WorkerEndpoint, RouteDecision]:
        assert self.plan is not None and self.prefill_life is not None
        eps = self.gw.choosable(self.plan.prefill, self.prefill_tried, self.req.model)
        ep, decision = await self._choose(self.prefill_life, eps)
        self.prefill_worker = ep.worker_id
        return ep, decision

    async def _prefill_leg(self, ep: WorkerEndpoint, decision: RouteDecision, body: bytes) -> tuple[int, list, bytes]:
        """``body`` to the prefill worker ``ep`` (engaged, its load added): its whole
        answer; _Upstream (counted against it) when it failed. The leg's load ends with it."""
        assert self.prefill_life is not None
        prefilled = False
        try:
            resp = await self._post(ep, decision, body)
            try:
                answer = await resp.read()
            except UpstreamError as exc:
                raise _Upstream(ep.worker_id, "broken", upstream_failed(
                    502, f"prefill worker {ep.worker_id}'s answer broke off: {type(exc).__name__}: {exc}")) from None
            finally:
                resp.close()
            prefilled = resp.status == 200
            if prefilled:
                self.prefill_usage = body_usage(answer)
            self.gw.health.succeeded(ep.worker_id)
            return resp.status, self._relayed(resp), answer
        except _Upstream as exc:
            self.prefill_tried.add(ep.worker_id)
            self._failed(exc)
            raise
        finally:
            # Shielded: a leg cancelled with its client still gives its load back.
            await asyncio.shield(self._prefill_ended(ep.worker_id, prefilled))

    async def _prefill_ended(self, worker: int, prefilled: bool) -> None:
        assert self.prefill_life is not None
        self.gw.release(worker)
        if prefilled:
            await self.prefill_life.prefill_done()
        await self.prefill_life.free()

    async def _nixl_prefill(self) -> tuple[int, list, bytes] | None:
        """vLLM's prefill leg, retried on other prefill workers; then the decode leg's body
        carries its ``kv_transfer_params``. The prefill worker's answer when it refused the
        request (4xx: the client's answer); ApiError when no prefill worker could do it."""
        body = disagg.nixl_prefill_body(self.req.body)
        last: _Upstream | None = None
        for _ in range(1 + self.gw.options.retries):
            try:
                ep, decision = await self._choose_prefill()
            except ApiError:
                if last is None:
                    raise
                break
            try:
                status, headers, answer = await self._prefill_leg(ep, decision, body)
            except _Upstream as exc:
                last = exc
                continue
            if status != 200:
                return status, headers, answer
            try:
                params = disagg.nixl_transfer_params(answer)
            except ValueError as exc:
                self.outcome = "upstream_prefill"
                raise upstream_failed(502, f"prefill worker {ep.worker_id}: {exc}") from None
            self.raw = disagg.nixl_decode_body(self.req.body, params)
            return None
        assert last is not None
        self.outcome = f"upstream_{last.reason}"
        raise last.error

    # -- the answer ----------------------------------------------------------------------

    def _relayed(self, resp: Response) -> list[tuple[bytes, bytes]]:
        return [(k, v) for k, v in resp.headers if k not in _NOT_RELAYED]

    async def _start(self, send: Any, status: int, headers: list[tuple[bytes, bytes]], length: int | None) -> None:
        self.status = status
        headers = headers + [
            (b"x-request-id", self.request_id.encode()),
            (b"x-kvstream-worker", str(self.tried_last).encode()),
            (b"x-kvstream-cached-tokens", str(self.predicted).encode()),
        ]
        if self.prefill_worker is not None:
            headers.append((b"x-kvstream-prefill-worker", str(self.prefill_worker).encode()))
        if length is not None:
            headers.append((b"content-length", str(length).encode()))
        await send({"type": "http.response.start", "status": status, "headers": headers})

    async def _relay_whole(self, resp: Response, send: Any) -> None:
        try:
            body = await resp.read()
        except UpstreamError as exc:
            self.outcome = "upstream_broken"
            self.gw.health.failed(self.worker, str(exc))  # type: ignore[arg-type]
            self.gw.metrics.upstream_failures.labels(worker=str(self.worker), reason="broken_answer").inc()
            raise upstream_failed(502, f"worker {self.worker}'s answer broke off: {type(exc).__name__}: {exc}") from None
        self.response = None
        self.finished = True
        await self._start(send, resp.status, self._relayed(resp), len(body))
        await send({"type": "http.response.body", "body": body})
        # The load's bookkeeping after the answer left: it costs the client nothing.
        if resp.status == 200:
            self.first_at = time.perf_counter()
            await self.life.prefill_done()
            self.usage = body_usage(body)
        else:
            self.outcome = f"worker_{resp.status}"

    async def _relay_stream(self, resp: Response, send: Any) -> None:
        await self._start(send, 200, self._relayed(resp), None)
        itl = self.gw.metrics.of(self.gw.metrics.itl, self.req.model)
        pending: bytes | None = b""  # the events not yet known to hold content (None: found)
        tail = _Tail(_TAIL)  # the stream's last bytes, for its usage
        seen = 0.0
        try:
            while chunk := await resp.next():
                now = time.perf_counter()
                tail.add(chunk)
                if ended := resp.ended:  # the worker's last bytes end the client's answer in the same write
                    self.response = None
                    self.usage = stream_usage(bytes(tail))
                    self.finished = True
                await send({"type": "http.response.body", "body": chunk, "more_body": not ended})
                if pending is not None:
                    pending = _content_in(pending + chunk)
                    if pending is None:
                        self.first_at = now
                        await self.life.prefill_done()  # after the chunk left: it costs the client nothing
                else:
                    itl.observe(now - seen)
                if ended:
                    return
                seen = now
        except UpstreamError as exc:
            self.outcome = "upstream_broken"
            self.gw.health.failed(self.worker, str(exc))  # type: ignore[arg-type]
            self.gw.metrics.upstream_failures.labels(worker=str(self.worker), reason="broken_stream").inc()
            error = upstream_failed(502, f"worker {self.worker}'s stream broke off: {type(exc).__name__}: {exc}")
            await send({"type": "http.response.body", "body": b"data: " + orjson.dumps({"error": error.fields()}) + b"\n\n",
                        "more_body": True})
        else:
            self.response = None
        self.usage = stream_usage(bytes(tail))
        self.finished = True
        await send({"type": "http.response.body", "body": b""})


async def _settle(task: asyncio.Future) -> None:
    """``task`` ended: cancelled if still running, and waited for (its cleanup runs),
    its failure already counted where it happened."""
    if not task.done():
        task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):  # noqa: BLE001 - the leg's own failure, already handled
        pass
