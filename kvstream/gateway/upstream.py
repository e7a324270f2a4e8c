"""The gateway's HTTP/1.1 client to the workers: keep-alive connections on asyncio
Protocols, responses parsed by ``httptools`` (llhttp, as uvicorn parses requests).

What the relay needs and no more: a request written as one buffer (head and body, in one
system call), the answer's status and headers as soon as they are whole, then its body
as it arrives, dechunked but otherwise the worker's bytes, each read handed over as one
piece (no per-event objects, no decoding). aiohttp's client, used before, cost four to
six times as much CPU per request (docs/BENCHMARKS.md, the gateway section).

Connections are kept per origin and reused most recent first (a warm one); one the worker
closed while idle leaves the pool when its close is seen. The close can also cross a new
request on the wire: an answer that never began on a reused connection (not a byte
came back) is sent once more, on a new connection. The worker closed an idle connection
as the request arrived, far likelier than a crash in between; and a request that fails
before its first byte is sent again anyway (to another worker, by the relay): this
keeps a keep-alive race from counting against the worker's breaker.

Bodies are framed by ``Content-Length``, ``chunked``, or the connection's end (HTTP/1.0
style); a response head over ``MAX_HEAD_BYTES`` or bytes that are not HTTP end the
connection with :class:`~kvstream.gateway.errors.UpstreamBroken`.

Timeouts: ``connect_timeout_s`` to get a connection (the wait for a free one under the
``limit`` included); ``read_timeout_s`` without a byte from the worker while an answer is
due (not while the relay has paused reading for a slow client).
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

import httptools

from kvstream.gateway.errors import (
    UpstreamBroken,
    UpstreamConnectError,
    UpstreamError,
    UpstreamTimeout,
)

#: Largest response head accepted (status line and headers).
MAX_HEAD_BYTES = 64 * 1024
#: Unread body bytes held for a slow reader before the worker's socket stops being read.
_HIGH_WATER = 1 << 20
#: Origins remembered (parsed base URLs); more are parsed again.
_MAX_ORIGINS = 4096


@dataclass(frozen=True, slots=True)
class Origin:
    """Where a worker is reached: scheme, host and port; ``prefix``: the base URL's path."""

    host: str
    port: int
    tls: bool
    #: The ``Host`` header (``host:port``, brackets around an IPv6 address).
    authority: bytes
    prefix: bytes

    @classmethod
    def parse(cls, base_url: str) -> Origin:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise UpstreamConnectError(f"{base_url!r} is not an http(s)://host[:port] URL")
        tls = parts.scheme == "https"
        try:
            port = parts.port or (443 if tls else 80)
        except ValueError:
            raise UpstreamConnectError(f"{base_url!r} has a bad port") from None
        host = parts.hostname
        shown = f"[{host}]" if ":" in host else host
        return cls(host, port, tls, f"{shown}:{port}".encode("idna"), parts.path.rstrip("/").encode())


def request_head(method: bytes, target: bytes, authority: bytes, headers: Sequence[tuple[bytes, bytes]], length: int | None) -> bytes:
    """The request's head; ``length`` None: no body (no ``Content-Length``).
    UpstreamConnectError when a header would break the framing (a CR or LF in it)."""
    parts = [method, b" ", target, b" HTTP/1.1\r\nhost: ", authority, b"\r\n"]
    for name, value in headers:
        parts += (name, b": ", value, b"\r\n")
    if length is not None:
        parts.append(b"content-length: %d\r\n" % length)
    parts.append(b"\r\n")
    head = b"".join(parts)
    # One count over the whole head instead of a check of every value.
    lines = len(headers) + 3 + (length is not None)
    if head.count(b"\n") != lines or head.count(b"\r") != lines:
        raise UpstreamConnectError("a request header holds a CR or LF (refused: it would split the request)")
    return head


class Response:
    """A worker's answer: ``status`` and ``headers`` (names lower-cased, in order) once
    its head is whole, then its body through :meth:`read` (whole) or :meth:`next` (as it
    arrives). :meth:`close` before the end closes the connection (the worker sees its
    client leave); an answer read to its end has given its connection back."""

    __slots__ = ("_conn", "_error", "_loop", "_parts", "_size", "_waiter", "complete", "got_bytes", "head_done",
                 "headers", "status")

    def __init__(self, conn: _Connection) -> None:
        self._conn: _Connection | None = conn
        self._loop = conn.loop
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_done = False
        self.complete = False
        #: Whether any byte of the answer arrived.
        self.got_bytes = False
        self._parts: list[bytes] = []
        self._size = 0
        self._error: UpstreamError | None = None
        self._waiter: asyncio.Future[None] | None = None

    @property
    def content_type(self) -> str:
        """The media type of ``Content-Type``, lower-cased, without its parameters."""
        for name, value in self.headers:
            if name == b"content-type":
                return value.split(b";", 1)[0].strip().lower().decode("latin-1")
        return ""

    @property
    def ended(self) -> bool:
        """Whether the body is whole and every byte of it has been read."""
        return self.complete and not self._parts

    async def head(self) -> None:
        while not self.head_done:
            await self._wait()

    async def read(self) -> bytes:
        """The whole body."""
        while not self.complete:
            await self._wait()
        parts, self._parts = self._parts, []
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def next(self) -> bytes:
        """The body bytes that arrived since the last call (waiting for some); b"" at its end."""
        while not self._parts:
            if self.complete:
                return b""
            await self._wait()
        parts, self._parts = self._parts, []
        self._size = 0
        if self._conn is not None:
            self._conn.resume()  # when paused for this reader
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def close(self) -> None:
        """Stop reading: an unfinished answer's connection is closed."""
        conn, self._conn = self._conn, None
        if conn is not None and not self.complete:
            conn.abort()

    async def _wait(self) -> None:
        if self._error is not None:
            raise self._error
        waiter = self._waiter = self._loop.create_future()
        try:
            await waiter
        finally:
            self._waiter = None
        if self._error is not None:
            raise self._error

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, error: UpstreamError) -> None:
        if not self.complete and self._error is None:
            self._error = error
            self._conn = None
            self._wake()


class _Connection(asyncio.Protocol):
    """One connection to a worker, one request at a time."""

    def __init__(self, pool: UpstreamPool, origin: Origin, loop: asyncio.AbstractEventLoop) -> None:
        self.pool, self.origin, self.loop = pool, origin, loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.resp: Response | None = None
        self.idle_since = 0.0
        self._head_bytes = 0
        #: Whether the current answer's body ends with the connection (no length, not chunked).
        self._until_eof = False
        self._interim = False
        self._keep_alive = False
        self._paused = False
        self._last_rx = 0.0
        self._read_timeout = 0.0
        self._timer: asyncio.TimerHandle | None = None

    # -- the pool's side ----------------------------------------------------------------

    @property
    def usable(self) -> bool:
        return self.transport is not None and not self.transport.is_closing() and self.resp is None

    def send(self, head: bytes, body: bytes, read_timeout_s: float) -> Response:
        assert self.transport is not None and self.resp is None
        resp = self.resp = Response(self)
        self._head_bytes, self._until_eof, self._interim, self._keep_alive = 0, False, False, False
        if body:
            self.transport.writelines((head, body))
        else:
            self.transport.write(head)
        self._read_timeout = read_timeout_s
        self._last_rx = self.loop.time()
        self._timer = self.loop.call_at(self._last_rx + read_timeout_s, self._check_idle)
        return resp

    def abort(self) -> None:
        self.resp = None
        if self.transport is not None:
            self.transport.abort()

    def resume(self) -> None:
        if self._paused and self.transport is not None:
            self._paused = False
            self._last_rx = self.loop.time()  # no byte was due while paused
            self.transport.resume_reading()

    # -- asyncio.Protocol -----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        resp = self.resp
        if resp is None:  # bytes nobody asked for: the connection cannot be trusted
            self._close()
            return
        self._last_rx = self.loop.time()
        resp.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._broken(UpstreamBroken(f"the worker's answer is not HTTP/1.1: {exc}"))
            return
        if not resp.head_done:
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                self._broken(UpstreamBroken(f"the worker's answer head is over {MAX_HEAD_BYTES} bytes"))
            return
        if resp.complete:
            self._done(resp)
        elif resp._parts:
            if resp._size > _HIGH_WATER and not self._paused and self.transport is not None:
                self._paused = True
                self.transport.pause_reading()
            resp._wake()

    def eof_received(self) -> bool | None:
        return None  # close the transport: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self._cancel_timer()
        self.pool._lost(self)
        resp, self.resp = self.resp, None
        if resp is None:
            return
        if exc is None and resp.head_done and self._until_eof:
            resp.complete = True  # the answer's end is the connection's
            resp._conn = None
            resp._wake()
            return
        why = f": {type(exc).__name__}: {exc}" if exc is not None else ""
        where = "before answering" if not resp.got_bytes else "before its answer was whole"
        resp._fail(UpstreamBroken(f"the worker closed the connection {where}{why}"))

    # -- httptools callbacks ------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.resp is not None:
            self.resp.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        resp = self.resp
        if resp is None:
            return
        status = self.parser.get_status_code()
        if status < 200:  # an interim answer (103 Early Hints, ...): the real one follows
            self._interim = True
            resp.headers = []
            return
        resp.status, resp.head_done = status, True
        if status not in (204, 304):
            framed = False
            for name, value in resp.headers:
                if name == b"content-length" or (name == b"transfer-encoding" and b"chunked" in value.lower()):
                    framed = True
                    break
            self._until_eof = not framed
        resp._wake()

    def on_body(self, body: bytes) -> None:
        resp = self.resp
        if resp is not None:
            resp._parts.append(body)
            resp._size += len(body)

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        if self.resp is not None:
            self.resp.complete = True
            # Now: once the callback returns, llhttp resets what this is computed from.
            self._keep_alive = self.parser.should_keep_alive()

    # -- the end of an answer -----------------------------------------------------------

    def _done(self, resp: Response) -> None:
        self._cancel_timer()
        self.resp = None
        resp._conn = None
        keep = self._keep_alive and not self._until_eof
        resp._wake()
        if keep and self.transport is not None and not self.transport.is_closing():
            if self._paused:
                self._paused = False
                self.transport.resume_reading()
            self.pool._give_back(self)
        else:
            self._close()

    def _broken(self, error: UpstreamError) -> None:
        resp, self.resp = self.resp, None
        if resp is not None:
            resp._fail(error)
        self._close()

    def _close(self) -> None:
        self._cancel_timer()
        if self.transport is not None:
            self.transport.abort()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check_idle(self) -> None:
        self._timer = None
        if self.resp is None:
            return
        due = self._last_rx + self._read_timeout
        if self._paused or due > self.loop.time():
            self._timer = self.loop.call_at(max(due, self.loop.time() + 0.001), self._check_idle)
            return
        self._broken(UpstreamTimeout(f"the worker sent nothing for {self._read_timeout:g}s"))


class UpstreamPool:
    """Keep-alive connections to the workers, ``limit`` open at most (0: no limit)."""

    def __init__(self, connect_timeout_s: float, read_timeout_s: float, limit: int = 0, keepalive_s: float = 60.0) -> None:
        self.connect_timeout_s, self.read_timeout_s = connect_timeout_s, read_timeout_s
        self.limit, self.keepalive_s = limit, keepalive_s
        self._idle: dict[Origin, list[_Connection]] = {}
        self._origins: dict[str, Origin] = {}
        self._open: set[_Connection] = set()
        self._connecting = 0
        self._slots: deque[asyncio.Future[None]] = deque()
        self._sweeper: asyncio.TimerHandle | None = None
        self._tls: ssl.SSLContext | None = None
        self._closed = False

    def origin(self, base_url: str) -> Origin:
        found = self._origins.get(base_url)
        if found is None:
            if len(self._origins) >= _MAX_ORIGINS:
                self._origins.clear()
            found = self._origins[base_url] = Origin.parse(base_url)
        return found

    async def request(
        self, base_url: str, method: bytes, path: bytes, headers: Sequence[tuple[bytes, bytes]], body: bytes = b"",
        read_timeout_s: float | None = None,
    ) -> Response:
        """Send a request to ``base_url`` + ``path`` and return its answer once its head
        is whole (its body still on its way). UpstreamConnectError when no connection
        could be had, UpstreamTimeout when no head came within the read timeout,
        UpstreamBroken when the connection broke first."""
        origin = self.origin(base_url)
        length = len(body) if body or method != b"GET" else None
        head = request_head(method, origin.prefix + path, origin.authority, headers, length)
        timeout = self.read_timeout_s if read_timeout_s is None else read_timeout_s
        conn, reused = await self._acquire(origin, fresh=False)
        while True:
            resp = conn.send(head, body, timeout)
            try:
                await resp.head()
            except UpstreamBroken:
                if reused and not resp.got_bytes:  # closed by the worker while idle: not read, safe to send again
                    conn, reused = await self._acquire(origin, fresh=True)
                    continue
                raise
            except BaseException:
                resp.close()  # cancelled while waiting: the worker sees its client leave
                raise
            return resp

    def close(self) -> None:
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
        for conn in list(self._open):
            conn.abort()
        self._idle.clear()
        for slot in self._slots:
            if not slot.done():
                slot.set_exception(UpstreamConnectError("the gateway is stopping"))

    # -- connections -------------------------------------------------------------------

    def _take_idle(self, origin: Origin) -> _Connection | None:
        idle = self._idle.get(origin)
        while idle:
            conn = idle.pop()
            if conn.usable:
                return conn
        return None

    async def _acquire(self, origin: Origin, fresh: bool) -> tuple[_Connection, bool]:
        """A connection to ``origin`` and whether it was idle in the pool (``fresh``:
        a new one): an idle one, else a new one when the limit allows, else one freed
        for it (an idle connection elsewhere is closed), waiting up to the connect timeout."""
        if not fresh and (conn := self._take_idle(origin)) is not None:
            return conn, True
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                while self.limit and len(self._open) + self._connecting >= self.limit:
                    if not fresh and (conn := self._take_idle(origin)) is not None:
                        return conn, True
                    victim = next((c for conns in self._idle.values() for c in conns), None)
                    if victim is not None:
                        self._idle_remove(victim)
                        self._open.discard(victim)
                        victim.abort()
                        continue
                    slot = loop.create_future()
                    self._slots.append(slot)
                    try:
                        await slot
                    finally:
                        if slot in self._slots:
                            self._slots.remove(slot)
                self._connecting += 1
                try:
                    _, conn = await loop.create_connection(
                        lambda: _Connection(self, origin, loop), origin.host, origin.port,
                        ssl=self._tls_context() if origin.tls else None,
                        server_hostname=origin.host if origin.tls else None,
                    )
                finally:
                    self._connecting -= 1
        except TimeoutError:
            self._pass_slot()
            raise UpstreamConnectError(f"no connection to {origin.host}:{origin.port} within {self.connect_timeout_s:g}s") from None
        except OSError as exc:  # refused, unreachable, name unknown, TLS failed (SSLError)
            self._pass_slot()
            raise UpstreamConnectError(f"cannot connect to {origin.host}:{origin.port}: {type(exc).__name__}: {exc}") from None
        except BaseException:
            self._pass_slot()
            raise
        if self._closed:
            conn.abort()
            raise UpstreamConnectError("the gateway is stopping")
        self._open.add(conn)
        return conn, False

    def _pass_slot(self) -> None:
        """A connection slot is free: the first request waiting for one gets it."""
        while self._slots:
            slot = self._slots.popleft()
            if not slot.done():
                slot.set_result(None)
                return

    def _tls_context(self) -> ssl.SSLContext:
        if self._tls is None:
            self._tls = ssl.create_default_context()
        return self._tls

    def _give_back(self, conn: _Connection) -> None:
        if self._closed:
            conn.abort()
            return
        conn.idle_since = conn.loop.time()
        self._idle.setdefault(conn.origin, []).append(conn)
        if self._slots:  # someone waits for a connection slot: an idle one is as good
            self._pass_slot()
        if self._sweeper is None:
            self._sweeper = conn.loop.call_later(self.keepalive_s, self._sweep)

    def _lost(self, conn: _Connection) -> None:
        if conn in self._open:
            self._open.discard(conn)
            self._idle_remove(conn)
            self._pass_slot()

    def _idle_remove(self, conn: _Connection) -> None:
        idle = self._idle.get(conn.origin)
        if idle and conn in idle:
            idle.remove(conn)

    def _sweep(self) -> None:
        """Close the connections idle for ``keepalive_s``."""
        self._sweeper = None
        loop = asyncio.get_running_loop()
        cut = loop.time() - self.keepalive_s
        for origin, conns in list(self._idle.items()):
            stale = [c for c in conns if c.idle_since <= cut]
            for c in stale:
                conns.remove(c)
                c.abort()
            if not conns:
                del self._idle[origin]
        if any(self._idle.values()):
            self._sweeper = loop.call_later(self.keepalive_s, self._sweep)

