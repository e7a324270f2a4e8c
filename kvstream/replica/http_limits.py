"""Limits of the replica's HTTP server, so that no client (slow, large or many) can take
memory, the event loop or file descriptors from the others: ``/healthz`` keeps answering.

- :class:`BodyLimit` (ASGI middleware): a request body larger than ``max_body_bytes`` is
  refused with 413 before anything parses it (by its ``Content-Length``, or counted as it
  streams in), and one that does not arrive within ``body_timeout_s`` with 408. All
  requests together hold at most ``max_buffered_body_bytes`` of bodies (announced
  lengths reserved up front, streamed ones counted as they come): past it, 429, and
  what a request took is given back when it ends.
- :func:`guarded_protocol` (uvicorn's httptools protocol, extended): a connection must
  send a request's headers within ``header_timeout_s`` (slowloris), and at most
  ``max_connections`` are open; the next one first evicts the oldest connection still
  waiting for its headers, else the oldest still receiving its body (a trickled upload),
  and is closed at once only if every connection is busy with a whole request. Beyond
  that, ``probe_connections`` more are kept for ``/healthz`` and ``/readyz`` alone, so
  that health checks answer while routing connections are full (a request for another
  path on one of them is answered 503). (It also writes each response's head and body
  together: not a limit, a cost per request.)
- A route request of at most ``inline_route_bytes`` is decided on the event loop (the
  decision of an 8k-token prompt takes tens of microseconds, less than a thread hop);
  larger ones in ``route_threads`` worker threads (kvstream.replica.service), and
  ``/v1/snapshot`` streams chunk by chunk to at most ``snapshot_streams`` readers at once.
"""

from __future__ import annotations

import asyncio
import resource
from collections.abc import Callable
from typing import Any

import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from kvstream.logs import get_logger
from kvstream.replica.options import HttpLimits

log = get_logger(__name__)

#: File descriptors kept for everything but HTTP connections (Kafka clients, RocksDB).
FD_RESERVE = 256


Reject = Callable[[str], None]

#: Paths served on the connections kept for health checks.
PROBE_PATHS = frozenset({"/healthz", "/readyz"})


class _Refused(Exception):
    def __init__(self, status: int, limit: str, message: str) -> None:
        super().__init__(message)
        self.status, self.limit = status, limit


class _Gone(Exception):
    """The client went (or was evicted) before its body was whole: nobody to answer."""


async def _send_error(send: Callable, status: int, message: str) -> None:
    body = orjson.dumps({"error": message})
    await send({
        "type": "http.response.start",
        "status": status,
        # The rest of the body is never read: the connection cannot be reused.
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close")],
    })
    await send({"type": "http.response.body", "body": body})


class BodyLimit:
    """ASGI middleware: a byte cap and a deadline on request bodies."""

    def __init__(self, app: Any, limits: HttpLimits, on_reject: Reject) -> None:
        self.app, self.limits, self.on_reject = app, limits, on_reject
        #: Body bytes held by requests in progress (one event loop: no lock needed).
        self.buffered = 0

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        cap = self.limits.max_body_bytes
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > cap):
            self.on_reject("body_too_large")
            await _send_error(send, 413, f"request body is larger than {cap} bytes")
            return
        # Body bytes this request holds against the budget: an announced length is
        # reserved whole before any of it is read, a streamed body as it arrives.
        held = int(length) if length is not None else 0
        if held and not self._take(held):
            self.on_reject("body_budget")
            await _send_error(send, 429, self._spent())
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.limits.body_timeout_s
        received = 0
        done = False
        started = False

        async def limited_receive() -> dict:
            nonlocal received, done, held
            if done:  # after the body: e.g. waiting for a disconnect while streaming
                return await receive()
            try:
                # A timeout scope, not wait_for: no task per message.
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise _Refused(408, "body_timeout", f"request body not received within {self.limits.body_timeout_s}s") from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > cap:
                    raise _Refused(413, "body_too_large", f"request body is larger than {cap} bytes")
                if received > held:
                    if not self._take(received - held):
                        raise _Refused(429, "body_budget", self._spent())
                    held = received
                done = not message.get("more_body", False)
            else:
                raise _Gone()
            return message

        async def tracking_send(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _Refused as exc:
            self.on_reject(exc.limit)
            if started:
                raise
            await _send_error(send, exc.status, str(exc))
        except _Gone:
            if started:
                raise
        finally:
            self.buffered -= held

    def _take(self, n: int) -> bool:
        if self.buffered + n > self.limits.max_buffered_body_bytes:
            return False
        self.buffered += n
        return True

    def _spent(self) -> str:
        return (f"the request bodies in progress hold max_buffered_body_bytes "
                f"({self.limits.max_buffered_body_bytes}): retry later")


class _HeadWithBody:
    """One response's view of its connection's transport: the response head is held until
    the first bytes of the body, and both leave in one write (one system call, one TCP
    segment) instead of uvicorn's two, which cost as much as a routing decision."""

    __slots__ = ("_cycle", "_head", "_sent", "_transport")

    def __init__(self, transport: asyncio.Transport, cycle: Any) -> None:
        self._transport = transport
        self._cycle: Any = cycle
        self._head: bytes | None = None
        self._sent = False  # the head has left (or is held)
        respond = cycle.on_response

        def on_response() -> None:  # the response ended; one without body bytes (HEAD): its head now
            self.flush()
            # Unlinked from the cycle: the two refer to each other, and a cycle per request
            # would leave every request's objects to the garbage collector's pauses.
            self._cycle = None
            respond()

        cycle.on_response = on_response

    def write(self, data: bytes) -> None:
        # The head is the first write once the response has started (a "100 Continue"
        # is written before it, and passes at once).
        if not self._sent and self._cycle is not None and self._cycle.response_started:
            self._head, self._sent = data, True
        elif self._head is not None:
            head, self._head = self._head, None
            self._transport.writelines((head, data))
        else:
            self._transport.write(data)

    def flush(self) -> None:
        if self._head is not None:
            head, self._head = self._head, None
            self._transport.write(head)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


async def _probes_only(scope: dict, receive: Callable, send: Callable) -> None:
    """What a connection kept for health checks answers to any other path."""
    await _send_error(send, 503, "every connection is busy: this one serves only /healthz and /readyz")


def guarded_protocol(limits: HttpLimits, on_reject: Reject) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with a header deadline, a connection cap (with room
    kept for health checks), and each response's head and body in one write."""

    class Guarded(HttpToolsProtocol):
        _header_timer: asyncio.TimerHandle | None = None
        #: When the current request began (loop time), while its headers are pending.
        _waiting_since: float | None = None
        #: When the current request's body began (loop time), until it is whole.
        _body_since: float | None = None
        #: Accepted beyond max_connections: serves only PROBE_PATHS.
        _probe_only = False

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            probe_only = False
            if len(self.connections) >= limits.max_connections and not self._evict():
                if len(self.connections) >= limits.max_connections + limits.probe_connections:
                    self.transport = transport  # connection_lost expects one
                    on_reject("connections")
                    transport.close()
                    return
                probe_only = True
            super().connection_made(transport)
            self._probe_only = probe_only
            self._arm()

        def _evict(self) -> bool:
            """Close the connection that has waited longest for its headers, else the one
            that has been receiving its body longest (a trickled upload holds a slot
            as a slowloris does; a request whose body is whole is never cut)."""
            waiting = [c for c in self.connections if getattr(c, "_waiting_since", None) is not None]
            if not waiting:
                waiting = [c for c in self.connections if getattr(c, "_body_since", None) is not None]
                if not waiting:
                    return False
                victim = min(waiting, key=lambda c: c._body_since)
                on_reject("connections")
                victim._close_receiving()
                return True
            victim = min(waiting, key=lambda c: c._waiting_since)
            on_reject("connections")
            victim._close_waiting()
            return True

        def _close_receiving(self) -> None:
            self._body_since = None
            self.connections.discard(self)
            self.transport.close()

        def _start_asgi_task(self, cycle: Any, app: Any) -> None:
            if self._probe_only and cycle.scope["path"] not in PROBE_PATHS:
                on_reject("connections")
                cycle.keep_alive = False
                app = _probes_only
            super()._start_asgi_task(cycle, app)

        def _arm(self) -> None:
            if self._header_timer is None:
                self._waiting_since = self.loop.time()
                self._header_timer = self.loop.call_later(limits.header_timeout_s, self._header_timeout)

        def _disarm(self) -> None:
            self._waiting_since = None
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_timeout(self) -> None:
            self._header_timer = None
            on_reject("header_timeout")
            self._close_waiting()

        def _close_waiting(self) -> None:
            self._disarm()
            self.connections.discard(self)  # now, not when the loop gets to connection_lost
            self.transport.close()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            self._body_since = self.loop.time()  # until on_message_complete
            super().on_headers_complete()
            cycle = self.cycle  # the new request's (its task has not run yet)
            if cycle is not None and not isinstance(cycle.transport, _HeadWithBody):
                cycle.transport = _HeadWithBody(cycle.transport, cycle)

        def on_message_complete(self) -> None:
            self._body_since = None
            super().on_message_complete()

        def on_response_complete(self) -> None:
            idle = not self.pipeline
            super().on_response_complete()
            if idle and not self.transport.is_closing():
                self._arm()  # an idle keep-alive connection waits for headers too

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return Guarded


def fit_connections(wanted: int, probes: int = 0) -> int:
    """Raise the soft limit of open files to the hard one, and return how many HTTP
    connections fit under it (``wanted`` at most), with ``probes`` more kept for health
    checks: running out of descriptors would stop ``accept`` for everyone, health checks
    included."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    fit = max(2, soft - FD_RESERVE - probes)
    if fit < wanted:
        log.warning("max_connections lowered to fit the open-files limit", wanted=wanted, nofile=soft, max_connections=fit)
    return min(wanted, fit)
