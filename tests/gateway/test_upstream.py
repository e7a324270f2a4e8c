"""The gateway's upstream HTTP/1.1 client (kvstream.gateway.upstream) against real
servers on loopback: aiohttp's web server for well-formed answers (what it sends is
also read by httpx, an independent client), and scripted asyncio servers that answer
with exact bytes for what a well-behaved server never does (a stream cut mid-chunk, a
connection closed while idle or as a request arrives, an oversized head, HTTP/1.0)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
import uvloop
from aiohttp import web

from kvstream.gateway.errors import (
    UpstreamBroken,
    UpstreamConnectError,
    UpstreamTimeout,
)
from kvstream.gateway.upstream import MAX_HEAD_BYTES, UpstreamPool
from tests.gateway.backends import closed_port

JSON = [(b"content-type", b"application/json")]
LOOPS = pytest.mark.parametrize("run", [asyncio.run, uvloop.run], ids=["asyncio", "uvloop"])


def pool(**kw: Any) -> UpstreamPool:
    return UpstreamPool(kw.pop("connect_timeout_s", 2.0), kw.pop("read_timeout_s", 5.0), **kw)


@asynccontextmanager
async def aiohttp_server(peers: list[tuple[str, int]]):
    """An aiohttp app: ``/len`` (Content-Length), ``/chunks`` (chunked, one write per
    chunk), ``/echo``; every request's client address is appended to ``peers``."""

    async def length(request: web.Request) -> web.Response:
        peers.append(request.transport.get_extra_info("peername"))
        return web.Response(body=b"x" * 5000, headers={"x-a": "1", "X-Mixed-Case": "v"})

    async def chunks(request: web.Request) -> web.StreamResponse:
        peers.append(request.transport.get_extra_info("peername"))
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(50):
            await resp.write(b"data: %d\n\n" % i)
        await resp.write_eof()
        return resp

    async def echo(request: web.Request) -> web.Response:
        peers.append(request.transport.get_extra_info("peername"))
        body = await request.read()
        seen = "\n".join(f"{k.lower()}: {v}" for k, v in request.headers.items())
        return web.Response(body=body + b"|" + seen.encode())

    app = web.Application()
    app.router.add_get("/len", length)
    app.router.add_get("/chunks", chunks)
    app.router.add_post("/echo", echo)
    runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    finally:
        await runner.cleanup()


Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


@asynccontextmanager
async def scripted(script: Script):
    """A server that runs ``script(reader, writer, n)`` for its n-th connection (from 0)."""
    count = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal count
        n, count = count, count + 1
        try:
            await script(reader, writer, n)
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", lambda: count
    finally:
        server.close()


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")), 0)
    return head + await reader.readexactly(length)


@LOOPS
def test_keep_alive_reuse_and_bodies_as_httpx_reads_them(run) -> None:
    async def main() -> None:
        peers: list[tuple[str, int]] = []
        async with aiohttp_server(peers) as url:
            p = pool()
            for path in (b"/len", b"/chunks", b"/len", b"/chunks"):
                r = await p.request(url, b"GET", path, ())
                assert r.status == 200
                got = await r.read()
                want = await asyncio.to_thread(httpx.get, url + path.decode())
                assert got == want.content
                if path == b"/len":
                    assert (b"x-a", b"1") in r.headers and (b"x-mixed-case", b"v") in r.headers
                else:
                    assert r.content_type == "text/event-stream"
            # Four answers over one connection (httpx's own requests came from other ports).
            ours = [peers[i] for i in (0, 2, 4, 6)]
            assert len(set(ours)) == 1
            # A stream read piece by piece gives the same bytes.
            r = await p.request(url, b"GET", b"/chunks", ())
            pieces = []
            while piece := await r.next():
                pieces.append(piece)
            assert b"".join(pieces) == b"".join(b"data: %d\n\n" % i for i in range(50)) and r.ended
            assert peers[-1] == ours[0]
            p.close()

    run(main())


def test_the_request_is_one_buffer_with_the_body_byte_for_byte() -> None:
    async def main() -> None:
        peers: list[tuple[str, int]] = []
        async with aiohttp_server(peers) as url:
            p = pool()
            body = b'{"a": [1, 2.50, "caf\\u00e9"],  "b":null}\n'
            r = await p.request(url + "/", b"POST", b"/echo", [*JSON, (b"x-custom", b"kept")], body)
            got, _, headers = (await r.read()).partition(b"|")
            assert got == body
            lines = headers.decode().splitlines()
            assert "x-custom: kept" in lines and f"content-length: {len(body)}" in lines
            assert any(line.startswith("host: 127.0.0.1:") for line in lines)
            p.close()

    asyncio.run(main())


@LOOPS
def test_a_stream_cut_mid_chunk_is_broken_after_what_arrived(run) -> None:
    async def script(reader, writer, n) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                     b"8\r\ndata: 1\n\r\n20\r\ndata: par")
        await writer.drain()

    async def main() -> None:
        async with scripted(script) as (url, _):
            p = pool()
            r = await p.request(url, b"POST", b"/v1/completions", JSON, b"{}")
            assert await r.next() == b"data: 1\ndata: par"  # as it arrived, a chunk's start included
            with pytest.raises(UpstreamBroken, match="before its answer was whole"):
                while await r.next():
                    pass
            assert not p._open  # the broken connection is gone
            p.close()

    run(main())


def test_content_length_short_of_its_promise_is_broken() -> None:
    async def script(reader, writer, n) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly this")

    async def main() -> None:
        async with scripted(script) as (url, _):
            p = pool()
            r = await p.request(url, b"GET", b"/", ())
            with pytest.raises(UpstreamBroken):
                await r.read()
            p.close()

    asyncio.run(main())


@LOOPS
def test_a_connection_closed_while_idle_is_not_reused(run) -> None:
    async def script(reader, writer, n) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        await asyncio.sleep(0.05)  # then the server closes it, idle (its keep-alive timeout)

    async def main() -> None:
        async with scripted(script) as (url, connections):
            p = pool()
            for _ in range(3):
                r = await p.request(url, b"GET", b"/", ())
                assert await r.read() == b"ok"
                await asyncio.sleep(0.2)  # the close is seen: the connection leaves the pool
                assert not p._open and not any(p._idle.values())
            assert connections() == 3
            p.close()

    run(main())


@LOOPS
def test_a_reused_connection_closed_as_the_request_arrives_is_resent_once_on_a_new_one(run) -> None:
    requests: list[int] = []

    async def script(reader, writer, n) -> None:
        await read_request(reader)
        requests.append(n)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\n\r\none")
        await writer.drain()
        if n == 0:
            await reader.readuntil(b"\r\n\r\n")  # the second request: closed unanswered, unread
            return
        await read_request(reader)  # a keep-alive connection: the next request is answered
        requests.append(n)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\n\r\ntwo")
        await writer.drain()
        await asyncio.sleep(1)

    async def main() -> None:
        async with scripted(script) as (url, connections):
            p = pool()
            r = await p.request(url, b"POST", b"/", JSON, b"{}")
            assert await r.read() == b"one"
            r = await p.request(url, b"POST", b"/", JSON, b"{}")  # reused, closed unanswered: sent again
            assert await r.read() == b"one"
            assert connections() == 2 and requests == [0, 1]
            r = await p.request(url, b"POST", b"/", JSON, b"{}")  # the new one is kept
            assert await r.read() == b"two" and connections() == 2
            p.close()

    run(main())


def test_a_new_connection_closed_unanswered_is_not_resent() -> None:
    async def script(reader, writer, n) -> None:
        await read_request(reader)  # read, then closed: the worker may have acted on it

    async def main() -> None:
        async with scripted(script) as (url, connections):
            p = pool()
            with pytest.raises(UpstreamBroken, match="before answering"):
                await p.request(url, b"POST", b"/", JSON, b"{}")
            assert connections() == 1
            p.close()

    asyncio.run(main())


def test_an_oversized_head_is_refused() -> None:
    async def script(reader, writer, n) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\n")
        for _ in range(MAX_HEAD_BYTES // 1000 + 2):
            writer.write(b"x-big: " + b"v" * 1000 + b"\r\n")
        await writer.drain()
        await asyncio.sleep(1)

    async def main() -> None:
        async with scripted(script) as (url, _):
            p = pool()
            with pytest.raises(UpstreamBroken, match="head is over"):
                await p.request(url, b"GET", b"/", ())
            p.close()

    asyncio.run(main())


def test_not_http_is_refused() -> None:
    async def script(reader, writer, n) -> None:
        await read_request(reader)
        writer.write(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(1)

    async def main() -> None:
        async with scripted(script) as (url, _):
            p = pool()
            with pytest.raises(UpstreamBroken, match="not HTTP/1.1"):
                await p.request(url, b"GET", b"/", ())
            p.close()

    asyncio.run(main())


@LOOPS
def test_http_1_0_answers_end_with_the_connection(run) -> None:
    async def script(reader, writer, n) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.0 200 OK\r\ncontent-type: text/plain\r\n\r\nhello ")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(b"world")

    async def main() -> None:
        async with scripted(script) as (url, connections):
            p = pool()
            for _ in range(2):
                r = await p.request(url, b"GET", b"/", ())
                assert r.status == 200 and await r.read() == b"hello world"
            assert connections() == 2  # never kept
            p.close()

    run(main())


def test_an_interim_answer_is_skipped() -> None:
    async def script(reader, writer, n) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n"
                     b"HTTP/1.1 201 Created\r\ncontent-length: 4\r\nx-b: 2\r\n\r\ndone")
        await writer.drain()
        await asyncio.sleep(1)

    async def main() -> None:
        async with scripted(script) as (url, _):
            p = pool()
            r = await p.request(url, b"GET", b"/", ())
            assert r.status == 201 and r.headers == [(b"content-length", b"4"), (b"x-b", b"2")]
            assert await r.read() == b"done"
            p.close()

    asyncio.run(main())


@LOOPS
def test_read_timeout_before_the_head_and_within_the_body(run) -> None:
    async def script(reader, writer, n) -> None:
        await read_request(reader)
        if n == 1:
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nhi\r\n")
            await writer.drain()
        await asyncio.sleep(5)

    async def main() -> None:
        async with scripted(script) as (url, _):
            p = pool(read_timeout_s=0.3)
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            with pytest.raises(UpstreamTimeout):
                await p.request(url, b"GET", b"/", ())
            assert 0.25 <= loop.time() - t0 < 2
            r = await p.request(url, b"GET", b"/", ())
            assert await r.next() == b"hi"
            with pytest.raises(UpstreamTimeout, match="sent nothing for 0.3s"):
                await r.next()
            p.close()

    run(main())


def test_connect_errors_and_header_injection() -> None:
    async def main() -> None:
        p = pool(connect_timeout_s=1)
        with pytest.raises(UpstreamConnectError, match="cannot connect"):
            await p.request(f"http://127.0.0.1:{closed_port()}", b"GET", b"/", ())
        with pytest.raises(UpstreamConnectError, match="not an http"):
            await p.request("ftp://127.0.0.1:1", b"GET", b"/", ())
        with pytest.raises(UpstreamConnectError, match="CR or LF"):
            await p.request("http://127.0.0.1:1", b"GET", b"/", [(b"authorization", b"Bearer k\r\nx-evil: 1")])
        p.close()

    asyncio.run(main())


def test_the_connection_limit_queues_and_reuses() -> None:
    async def main() -> None:
        peers: list[tuple[str, int]] = []
        async with aiohttp_server(peers) as url:
            p = pool(limit=1)

            async def one() -> bytes:
                r = await p.request(url, b"GET", b"/chunks", ())
                return await r.read()

            got = await asyncio.gather(*(one() for _ in range(4)))
            assert len(set(got)) == 1 and len(set(peers)) == 1 and len(peers) == 4
            p.close()

    asyncio.run(main())


def test_close_before_the_end_closes_the_connection() -> None:
    seen: list[bytes] = []

    async def script(reader, writer, n) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nhi\r\n")
        await writer.drain()
        seen.append(await reader.read())  # b"": the client left

    async def main() -> None:
        async with scripted(script) as (url, _):
            p = pool()
            r = await p.request(url, b"GET", b"/", ())
            assert await r.next() == b"hi"
            r.close()
            for _ in range(100):
                if seen:
                    break
                await asyncio.sleep(0.01)
            assert seen == [b""] and not p._open
            p.close()

    asyncio.run(main())


def test_a_slow_reader_stops_the_reading_and_gets_every_byte() -> None:
    chunk = bytes(range(256)) * 256  # 64 KiB
    count = 64  # 4 MiB in all: more than the client holds for a reader

    async def script(reader, writer, n) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for _ in range(count):
            writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(1)

    async def main() -> None:
        async with scripted(script) as (url, _):
            p = pool(read_timeout_s=0.2)  # a paused read is no silence of the worker's
            r = await p.request(url, b"GET", b"/", ())
            await asyncio.sleep(0.5)
            assert r._conn is not None and r._conn._paused
            held = r._size
            assert held < 2 * 1024 * 1024
            got = []
            while piece := await r.next():
                got.append(piece)
                await asyncio.sleep(0.01)
            assert b"".join(got) == chunk * count
            p.close()

    asyncio.run(main())
