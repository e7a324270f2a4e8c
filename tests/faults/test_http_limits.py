"""Issue 13 (7, 8, 9): the replica's HTTP API against large, slow and many clients, and
its trust boundaries (scoped tokens, request ids, TLS), probed over loopback against a
real ``kvstream router`` process (run under a 1,024 open-files limit, as in the report)
with bounded counts and timeouts."""

from __future__ import annotations

import os
import random
import re
import resource
import socket
import ssl
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import httpx
import orjson
import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient

from kvstream.events.codec import EventCodec
from kvstream.events.model import Cleared, EventBatch, Stored, Tier
from kvstream.kafka.config import admin_config, producer_config
from kvstream.kafka.topics import ensure_topics
from kvstream.replica.errors import SnapshotError
from kvstream.replica.peer import fetch_peer_snapshot, receive_snapshot, stream_snapshot
from kvstream.replica.snapshot import SnapshotStore
from kvstream.replica.snapshotter import Snapshotter
from kvstream.settings import Settings, TopicSettings
from kvstream.tools.procs import free_port
from kvstream.worker.announce import register_synthetic

from tests.faults.helpers import (
    KVSTREAM,
    ROOT,
    router_env,
    rss_mib,
    stop_process,
    wait_http,
)
from tests.replica.helpers import FakeWorkerLog, new_fold
from tests.replica.raw_store import raw_keys

pytestmark = [pytest.mark.faults, pytest.mark.kafka]

TOKENS = list(range(16 * 8))
CLIENT, OPERATOR, PEER = "client-secret-1", "operator-secret-2", "peer-secret-3"
BIG_WORKER = 2
BIG_RECORDS, BIG_BLOCKS = 20, 50_000  # 1 M blocks on one worker
NOFILE = 1024


def hwm_mib(pid: int) -> float:
    """Peak resident memory of a process (VmHWM), MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def big_worker_records() -> list[bytes]:
    codec, rng = EventCodec(), random.Random(7)
    out, parent, eid = [], None, 1
    out.append(codec.encode(EventBatch(BIG_WORKER, 1, 10**9, (Cleared(BIG_WORKER, 0, Tier.DEVICE, 1, 0),))))
    for _ in range(BIG_RECORDS):
        seq = tuple(rng.getrandbits(64) for _ in range(BIG_BLOCKS))
        local = tuple(rng.getrandbits(64) for _ in range(BIG_BLOCKS))
        out.append(codec.encode(EventBatch(BIG_WORKER, 1, 10**9, (Stored(BIG_WORKER, 0, Tier.DEVICE, 1, eid, parent, seq, local),))))
        parent, eid = seq[-1], eid + 1
    return out


def produce(settings: Settings, records: list[tuple[int, bytes]]) -> None:
    register_synthetic(settings, [wid for wid, _ in records])  # as `kvstream worker` does
    p = Producer(producer_config(settings, **{"message.max.bytes": 2_000_000}))
    for wid, value in records:
        p.produce(settings.topics.name("events"), value=value, key=wid.to_bytes(8, "big"))
        p.poll(0)
    assert p.flush(60) == 0


@dataclass
class Router:
    proc: subprocess.Popen
    port: int
    settings: Settings
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def metric(self, pattern: str) -> float:
        text = httpx.get(self.url + "/metrics", timeout=10).text
        return sum(float(v) for v in re.findall(rf"^{pattern} (\S+)$", text, re.M))


def spawn(settings: Settings, port: int, log: Path, **replica: object) -> subprocess.Popen:
    """``kvstream router`` on loopback under a 1,024 open-files limit."""
    out = open(log, "ab")
    try:
        return subprocess.Popen(
            [str(KVSTREAM), "router", "--bootstrap", str(settings.bootstrap), "--port", str(port)],
            env=router_env(settings, **replica), stdout=out, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, cwd=ROOT,
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, NOFILE)),
        )
    finally:
        out.close()


def new_settings(bootstrap: str) -> Settings:
    settings = Settings(bootstrap=bootstrap, topics=TopicSettings(prefix=f"test.{uuid.uuid4().hex[:12]}.", events_partitions=2))
    ensure_topics(settings)
    return settings


def drop_topics(settings: Settings) -> None:
    admin = AdminClient(admin_config(settings))
    names = [n for n in admin.list_topics(timeout=30).topics if n.startswith(settings.topics.prefix)]
    for f in admin.delete_topics(names, request_timeout=30).values():
        f.result(timeout=30)


@pytest.fixture(scope="module")
def router(kafka_bootstrap: str, tmp_path_factory) -> Iterator[Router]:
    tmp = tmp_path_factory.mktemp("http")
    settings = new_settings(kafka_bootstrap)
    w = FakeWorkerLog(1, lease_ms=10**9)
    produce(settings, [(1, w.batch(w.cleared(), w.stored(TOKENS)))])
    (tmp / "client").write_text(CLIENT + "\n")
    (tmp / "peer").write_text(PEER)
    port = free_port()
    proc = spawn(
        settings, port, tmp / "router.log",
        header_timeout_s=1, body_timeout_s=2, snapshot_dir=tmp / "snap", snapshot_every_s=1,
        client_token_file=tmp / "client", peer_token_file=tmp / "peer", operator_token=OPERATOR,
    )
    try:
        wait_http(f"http://127.0.0.1:{port}/readyz", 60, proc)
        r = Router(proc, port, settings, tmp / "router.log")
        wait_worker(r.url, OPERATOR)
        yield r
    finally:
        stop_process(proc)
        drop_topics(settings)


def wait_worker(url: str, token: str, verify: object = True) -> None:
    deadline = time.monotonic() + 60
    while "1" not in httpx.get(url + "/v1/workers", headers=auth(token), verify=verify, timeout=10).json()["workers"]:
        assert time.monotonic() < deadline, "worker 1 was not folded"
        time.sleep(0.1)


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def raw_request(port: int, head: bytes, timeout: float = 10.0) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    s.sendall(head)
    return s


def read_status(s: socket.socket) -> int:
    data = b""
    while b"\r\n" not in data:
        chunk = s.recv(4096)
        if not chunk:
            raise AssertionError(f"connection closed without a status line: {data!r}")
        data += chunk
    return int(data.split(b" ", 2)[1])


# -- 9: tokens, scopes, docs -----------------------------------------------------------


def test_scoped_tokens_from_files_and_env(router: Router) -> None:
    cmdline = Path(f"/proc/{router.proc.pid}/cmdline").read_bytes()
    assert b"secret" not in cmdline, cmdline
    url = router.url
    route = {"token_ids": TOKENS, "query_only": True}
    assert httpx.post(url + "/v1/route", json=route, headers=auth(CLIENT)).status_code == 200
    for token in (OPERATOR, PEER, "wrong"):
        assert httpx.post(url + "/v1/route", json=route, headers=auth(token)).status_code == 401, token
    body = orjson.dumps(route)
    for header in (b"Authorization: Bearer \r\n", b"Authorization: Bearer\r\n", b"Authorization: \r\n"):
        head = b"POST /v1/route HTTP/1.1\r\nHost: x\r\n" + header + b"Content-Length: %d\r\n\r\n" % len(body)
        with raw_request(router.port, head + body) as s:
            assert read_status(s) == 401, header  # an empty token is never a token
    assert httpx.post(url + "/v1/route", json=route).status_code == 401
    # Routing clients can neither read the index nor free requests' ... of operators.
    assert httpx.get(url + "/v1/workers", headers=auth(CLIENT)).status_code == 401
    assert httpx.get(url + "/v1/snapshot", headers=auth(CLIENT)).status_code == 401
    assert httpx.get(url + "/v1/workers", headers=auth(PEER)).status_code == 401
    assert httpx.get(url + "/v1/workers", headers=auth(OPERATOR)).status_code == 200
    assert httpx.delete(url + "/v1/requests/x", headers=auth(OPERATOR)).status_code == 401
    for token in (OPERATOR, PEER):
        assert httpx.get(url + "/v1/snapshot", headers=auth(token)).status_code in (200, 503)
    for path in ("/docs", "/openapi.json", "/redoc"):
        assert httpx.get(url + path, headers=auth(OPERATOR)).status_code == 404
    assert httpx.get(url + "/healthz").status_code == 200


def test_open_bind_off_loopback_is_refused(tmp_path: Path) -> None:
    out = subprocess.run(
        [str(KVSTREAM), "router", "--host", "0.0.0.0", "--bootstrap", "127.0.0.1:1"],
        capture_output=True, text=True, timeout=60, env=router_env(Settings(bootstrap="127.0.0.1:1")),
    )
    assert out.returncode != 0 and "without a token" in out.stderr and "Traceback" not in out.stderr
    empty = tmp_path / "empty"
    empty.write_text("\n")
    out = subprocess.run(
        [str(KVSTREAM), "router", "--token-file", str(empty), "--bootstrap", "127.0.0.1:1"],
        capture_output=True, text=True, timeout=60, env=router_env(Settings(bootstrap="127.0.0.1:1")),
    )
    assert out.returncode != 0 and "is empty" in out.stderr and "Traceback" not in out.stderr


# -- 7: bodies, slow clients, many connections, long prompts ------------------------------


def test_body_cap_before_parsing(router: Router) -> None:
    before = hwm_mib(router.proc.pid)
    head = (f"POST /v1/route HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {CLIENT}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {100 * 1024 * 1024}\r\n\r\n").encode()
    with raw_request(router.port, head) as s:
        assert read_status(s) == 413  # by its Content-Length, before any of it is read
    # Streamed (chunked, no length): refused once the cap is passed, not after 100 MB.
    head = (f"POST /v1/route HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {CLIENT}\r\n"
            f"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n").encode()
    chunk = b"%x\r\n" % (1 << 20) + b"1," * (1 << 19) + b"\r\n"
    sent = 0
    with raw_request(router.port, head) as s:
        try:
            while sent < 100:
                s.sendall(chunk)
                sent += 1
        except OSError:
            pass  # the server answered and closed
        assert read_status(s) == 413
    grew = hwm_mib(router.proc.pid) - before
    print(f"FAULTS http_body sent_mib={sent} peak_rss_growth_mib={grew:.1f}")
    assert sent < 100 and grew < 96, (sent, grew)
    assert router.metric(r'kvstream_http_rejected_total\{limit="body_too_large"\}') >= 2


def read_answer(f: BinaryIO, method: str) -> tuple[int, bytes]:
    """One HTTP/1.1 answer (status, body) from a connection's buffered reader."""
    status = int(f.readline().split()[1])
    length = 0
    while (line := f.readline()) not in (b"\r\n", b""):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    return status, b"" if method == "HEAD" else f.read(length)


def test_responses_whole_after_continue_pipelining_head_and_errors(router: Router) -> None:
    """Each response's head leaves with its body (kvstream.replica.http_limits): a
    "100 Continue" still goes out before the body is sent, pipelined answers keep their
    order, and an answer without body bytes (HEAD) still leaves."""
    body = orjson.dumps({"token_ids": TOKENS, "query_only": True})
    head = (f"POST /v1/route HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {CLIENT}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n").encode()
    with raw_request(router.port, head + b"Expect: 100-continue\r\n\r\n") as s, s.makefile("rb") as f:
        assert f.readline() == b"HTTP/1.1 100 Continue\r\n" and f.readline() == b"\r\n"  # before any body
        s.sendall(body)
        status, answer = read_answer(f, "POST")
        assert status == 200 and orjson.loads(answer)["worker_id"] == 1
    wrong_method = b"GET /v1/route HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + CLIENT.encode() + b"\r\n\r\n"
    no_body = b"HEAD /healthz HTTP/1.1\r\nHost: x\r\n\r\n"  # 405 (no HEAD route), and uvicorn sends no body
    with raw_request(router.port, head + b"\r\n" + body + wrong_method + no_body + head + b"\r\n" + body) as s, \
            s.makefile("rb") as f:
        answers = [read_answer(f, method) for method in ("POST", "GET", "HEAD", "POST")]
    assert [status for status, _ in answers] == [200, 405, 405, 200]
    assert orjson.loads(answers[0][1]) == orjson.loads(answers[3][1])
    assert b"Method Not Allowed" in answers[1][1] and answers[2][1] == b""


def test_slow_body_times_out(router: Router) -> None:
    head = (f"POST /v1/route HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {CLIENT}\r\n"
            f"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{{\"token_ids\": [").encode()
    with raw_request(router.port, head) as s:
        assert read_status(s) == 408


def test_slowloris_does_not_starve_healthz(router: Router) -> None:
    """1,100 connections that never finish their headers, against a 1,024-fd process."""
    conns: list[socket.socket] = []
    try:
        for _ in range(1100):
            s = socket.create_connection(("127.0.0.1", router.port), timeout=5)
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # headers never end
            conns.append(s)
        answered = 0
        for _ in range(20):
            r = httpx.get(router.url + "/healthz", timeout=5)
            answered += r.status_code == 200
        assert answered == 20
        # The header deadline (1 s here) closes the rest.
        closed = 0
        for s in conns[-50:]:
            s.settimeout(10)
            try:
                closed += s.recv(1024) == b""
            except OSError:
                closed += 1
        assert closed == 50
        evicted = router.metric(r'kvstream_http_rejected_total\{limit="connections"\}')
        timed_out = router.metric(r'kvstream_http_rejected_total\{limit="header_timeout"\}')
        print(f"FAULTS http_slowloris connections=1100 nofile={NOFILE} healthz_ok={answered}/20 evicted={evicted:.0f} header_timeouts={timed_out:.0f}")
        assert evicted > 0 and timed_out > 0
    finally:
        for s in conns:
            s.close()


def test_million_token_prompt_does_not_block_the_loop(router: Router) -> None:
    tokens = [random.Random(3).randrange(1 << 31) for _ in range(1 << 20)]
    body = orjson.dumps({"token_ids": tokens, "query_only": True})
    head = (f"POST /v1/route HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {CLIENT}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    client = httpx.Client(timeout=10)
    with raw_request(router.port, head, timeout=120) as s:
        s.sendall(body)
        # While the server parses and routes it (1–2 s), /healthz keeps answering.
        s.setblocking(False)
        during, slowest = 0, 0.0
        while True:
            try:
                if s.recv(1, socket.MSG_PEEK):
                    break
            except BlockingIOError:
                pass
            t0 = time.perf_counter()
            assert client.get(router.url + "/healthz").status_code == 200
            slowest = max(slowest, time.perf_counter() - t0)  # reported, not asserted
            during += 1
        s.setblocking(True)
        assert read_status(s) == 200
    client.close()
    print(f"FAULTS http_1m_tokens healthz_answered_during_route={during} slowest_healthz_s={slowest:.3f}")
    # Blocked, the loop would answer at most the probe that raced the body's last bytes (main: 1).
    assert during >= 20, during


def test_snapshot_streams_are_bounded(router: Router, tmp_path: Path) -> None:
    """1 M blocks; 8 readers that stall: two streams at a time, chunk by chunk."""
    produce(router.settings, [(BIG_WORKER, v) for v in big_worker_records()])
    deadline = time.monotonic() + 120
    while True:
        w = httpx.get(router.url + "/v1/workers", headers=auth(OPERATOR), timeout=30).json()["workers"]
        if w.get(str(BIG_WORKER), {}).get("ranks", {}).get("0", {}).get("device") == BIG_RECORDS * BIG_BLOCKS:
            break
        assert time.monotonic() < deadline, "the big worker was not folded"
        time.sleep(0.5)
    blocks = 0.0
    while blocks < BIG_RECORDS * BIG_BLOCKS:  # a snapshot with all of it (every 1 s here)
        assert time.monotonic() < deadline, "no snapshot of the big worker"
        time.sleep(0.5)
        blocks = router.metric("kvstream_snapshot_blocks")
    before = rss_mib(router.proc.pid)  # now, not the peak: folding 1 M blocks peaked higher
    head = f"GET /v1/snapshot HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {OPERATOR}\r\n\r\n".encode()
    readers = [raw_request(router.port, head) for _ in range(8)]
    try:
        for s in readers:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        statuses = sorted(read_status(s) for s in readers)
        time.sleep(2.0)  # the two streams fill their socket buffers and wait
        grew = rss_mib(router.proc.pid) - before
        print(f"FAULTS http_snapshot_streams blocks={blocks:.0f} readers=8 statuses={statuses} rss_growth_mib={grew:.1f}")
        assert statuses == [200, 200] + [503] * 6 and grew < 64, (statuses, grew)
    finally:
        for s in readers:
            s.close()
    # The stalled streams end with their readers, and a whole stream is a valid
    # snapshot (what a peer receives).
    store = SnapshotStore(tmp_path / "copy")
    try:
        deadline = time.monotonic() + 30
        while True:
            with httpx.stream("GET", router.url + "/v1/snapshot", headers=auth(PEER), timeout=60) as resp:
                if resp.status_code == 200:
                    gen = receive_snapshot(resp.iter_raw(), store)
                    break
            assert resp.status_code == 503 and time.monotonic() < deadline, resp.status_code
            time.sleep(0.2)
        meta, _ = store.load(gen)
        assert meta.blocks() >= BIG_RECORDS * BIG_BLOCKS
    finally:
        store.close()


# -- 7: what a peer may send ---------------------------------------------------------------


def small_snapshot(path: Path) -> bytes:
    fold = new_fold()
    w = FakeWorkerLog(5, lease_ms=10**9)
    fold.apply_record(0, 0, 1, w.batch(w.cleared(), w.stored(TOKENS)))
    store = SnapshotStore(path)
    snap = Snapshotter(store, fold, "events", "tid", 1, 0, 0)
    snap.snapshot_now()
    snap.close()
    data = b"".join(stream_snapshot(store))
    store.close()
    return data


def test_peer_bootstrap_accepts_only_what_the_meta_announces(tmp_path: Path) -> None:
    good = small_snapshot(tmp_path / "src")

    def attempt(data: bytes, **kw) -> str:
        store = SnapshotStore(tmp_path / f"dst-{uuid.uuid4().hex[:6]}")
        try:
            with pytest.raises(SnapshotError) as info:
                receive_snapshot(iter([data[i : i + 1000] for i in range(0, len(data), 1000)]), store, **kw)
            assert store.candidates()[0] == []  # nothing committed
            with raw_keys(store) as db:
                assert not any(k.startswith(b"w") for k in db.keys())  # nor left behind
            return str(info.value)
        finally:
            store.close()

    assert "truncated" in attempt(good[:-5])
    assert "after its last worker" in attempt(good + b"x")
    assert "at most" in attempt(b"\0" * 8 + (1 << 40).to_bytes(8, "big"))
    assert "cap" in attempt(good, max_bytes=10)
    meta_len = int.from_bytes(good[8:16], "big")
    frame = 16 + meta_len
    assert "does not list" in attempt(good[:frame] + (6).to_bytes(8, "big") + good[frame + 8 :])
    longer = good[: frame + 8] + (int.from_bytes(good[frame + 8 : frame + 16], "big") + 1).to_bytes(8, "big") + good[frame + 16 :]
    assert "its meta says" in attempt(longer)
    store = SnapshotStore(tmp_path / "ok")
    assert receive_snapshot(iter([good]), store) >= 1
    store.close()


def test_peer_sending_gigabytes_is_cut_off(tmp_path: Path) -> None:
    """A peer that follows a valid snapshot with 1.5 GiB: refused at the first extra
    byte, with bounded memory (main buffered it all: +1.6 GiB)."""
    good = small_snapshot(tmp_path / "src")
    total = good
    junk = 3 * (1 << 29)
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    sent = [0]

    def serve() -> None:
        conn, _ = srv.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(f"HTTP/1.1 200 OK\r\nContent-Length: {len(total) + junk}\r\n\r\n".encode() + total)
            block = b"\0" * (1 << 20)
            try:
                while sent[0] < junk:
                    conn.sendall(block)
                    sent[0] += len(block)
            except OSError:
                pass

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    store = SnapshotStore(tmp_path / "dst")
    before = rss_mib(os.getpid())
    try:
        with pytest.raises(SnapshotError, match="after its last worker"):
            fetch_peer_snapshot(f"http://127.0.0.1:{port}", store, timeout=30)
        assert store.candidates()[0] == []
    finally:
        store.close()
        srv.close()
        t.join(30)
    grew = rss_mib(os.getpid()) - before
    print(f"FAULTS peer_junk sent_mib={sent[0] >> 20} of {junk >> 20} rss_growth_mib={grew:.1f}")
    assert sent[0] < junk and grew < 64


# -- 9: TLS ------------------------------------------------------------------------------------


def test_tls_with_a_self_signed_certificate(kafka_bootstrap: str, tmp_path: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )
    settings = new_settings(kafka_bootstrap)
    w = FakeWorkerLog(1, lease_ms=10**9)
    produce(settings, [(1, w.batch(w.cleared(), w.stored(TOKENS)))])
    port = free_port()
    proc = spawn(settings, port, tmp_path / "router.log", tls_certfile=cert, tls_keyfile=key,
                 token=OPERATOR, snapshot_dir=tmp_path / "snap", snapshot_every_s=1)
    try:
        url = f"https://127.0.0.1:{port}"
        ctx = ssl.create_default_context(cafile=str(cert))
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (tmp_path / "router.log").read_text()[-2000:]
            try:
                if httpx.get(url + "/readyz", verify=ctx, timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline
            time.sleep(0.2)
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5)  # plain HTTP is not served
        with pytest.raises(httpx.TransportError):
            httpx.get(url + "/healthz", timeout=5)  # an unknown CA is not trusted
        wait_worker(url, OPERATOR, ctx)
        r = httpx.post(url + "/v1/route", json={"token_ids": TOKENS, "query_only": True}, headers=auth(OPERATOR), verify=ctx)
        assert r.status_code == 200 and r.json()["worker_id"] == 1
        # A peer bootstraps over https, verifying the certificate.
        store = SnapshotStore(tmp_path / "peer")
        try:
            deadline = time.monotonic() + 30
            while True:
                try:
                    gen = fetch_peer_snapshot(url, store, OPERATOR, ca_file=cert)
                    break
                except SnapshotError as exc:
                    assert "503" in str(exc) and time.monotonic() < deadline, exc
                    time.sleep(0.5)
            assert store.load(gen)[0].blocks() >= 8
        finally:
            store.close()
    finally:
        stop_process(proc)
        drop_topics(settings)
