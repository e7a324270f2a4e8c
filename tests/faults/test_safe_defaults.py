"""Issue 28: what an adversary found against the default settings, each against the real
broker with real replicas (in process, or a ``kvstream router`` process) and the real
publisher (kvstream.worker.publisher) as the honest worker. Each test failed on the main
of the issue for the finding's reason (docs/RELIABILITY.md, "Issue 28")."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from confluent_kafka import Producer

from kvstream.events.codec import EventCodec
from kvstream.events.model import TICK_HEADER, Cleared, EventBatch, Stored, Tier
from kvstream.events.wire import worker_key
from kvstream.kafka.config import producer_config
from kvstream.replica.authority import WORKER_FULL
from kvstream.replica.fold import DUPLICATE, ID_CONFLICT, STALE_EPOCH
from kvstream.settings import Settings
from kvstream.tools.procs import free_port

from tests.faults.helpers import agrees_with_log, stop_process, wait_http
from tests.faults.test_http_limits import (
    CLIENT,
    NOFILE,
    OPERATOR,
    TOKENS,
    Router,
    auth,
    drop_topics,
    hwm_mib,
    new_settings,
    raw_request,
    read_status,
    spawn,
    wait_worker,
)
from tests.faults.test_http_limits import (
    produce as produce_big,
)
from tests.faults.test_log_authority import _produce_raw, _with_fold, chain
from tests.faults.test_worker_faults import (
    _last_event_id,
    blocks,
    epoch_truth,
    publisher,
    store,
    until,
)
from tests.replica.helpers import FakeWorkerLog
from tests.replica.test_replica_kafka import produce, start, wait_caught_up

pytestmark = [pytest.mark.faults, pytest.mark.kafka]

D = Tier.DEVICE
CODEC = EventCodec()
NS_PER_S = 1_000_000_000
# Named as operators see them (and as literals, so that this module also loads against
# the main of the issue, where the tests were first run).
PARTITION_FULL = "partition_block_limit"
DISPLACED = "worker_displaced"
DEFAULT_BLOCKS_PER_WORKER = 1 << 20  # kvstream.replica.authority.DEFAULT_BLOCKS_PER_WORKER


# -- 2: a plausible forged epoch ---------------------------------------------------------


@pytest.mark.timeout(120)
def test_a_forged_plausible_epoch_is_outranked_by_the_workers_resync(kafka_topics: Settings) -> None:
    pub, cons = publisher(kafka_topics, 75, listen_control=True)
    r = start(kafka_topics, resync_min_interval_s=1.0)
    try:
        store(cons, 100, 6)
        assert pub.flush(30) == 0
        wait_caught_up(r, kafka_topics)
        # A `cleared` for the live worker, keyed as it, 60 s ahead: inside
        # max_epoch_ahead_ms (300 s), so the authority lets it through.
        forged = pub.epoch + 60 * NS_PER_S
        _produce_raw(kafka_topics, [EventBatch(75, forged, 60_000, (Cleared(75, 0, D, forged, 0),))])
        until(lambda: r.fold.workers[75].epoch == forged, "the forged epoch accepted")
        first = pub.epoch
        chain(cons, 106, 4)  # the worker goes on in its own (now older) epoch
        until(lambda: pub.stats.resyncs >= 1, "the worker's resync", tick=lambda: pub.poll(cons))
        assert pub.flush(30) == 0 and pub.epoch > forged > first
        wait_caught_up(r, kafka_topics)
        with r.lock:
            assert r.fold.workers[75].epoch == pub.epoch
            healed = blocks(r.fold, 75)
            stale = r.fold.counters[STALE_EPOCH]
        assert healed == epoch_truth(kafka_topics, 75, pub.epoch) and len(healed) == 10
        assert stale >= 1 and r.metrics.resync_requests._value.get() >= 1
    finally:
        r.stop()
        pub.close()
    agrees_with_log(r, kafka_topics)
    print(f"FAULTS forged_epoch ahead_s=60 stale_batches={stale} resyncs={pub.stats.resyncs} blocks_after={len(healed)}")


# -- 3, 4: slow and large bodies against a `kvstream router` process, default limits --------


@pytest.fixture(scope="module")
def defaults_router(kafka_bootstrap: str, tmp_path_factory) -> Iterator[Router]:
    """``kvstream router`` with the default HTTP limits (body deadline 30 s, 16 MiB
    bodies, 64 MiB buffered at once, 16 connections kept for probes) under 1,024 fds."""
    tmp = tmp_path_factory.mktemp("defaults")
    settings = new_settings(kafka_bootstrap)
    w = FakeWorkerLog(1, lease_ms=10**9)
    produce_big(settings, [(1, w.batch(w.cleared(), w.stored(TOKENS)))])
    port = free_port()
    proc = spawn(settings, port, tmp / "router.log", client_token=CLIENT, operator_token=OPERATOR, http_docs=True)
    try:
        wait_http(f"http://127.0.0.1:{port}/readyz", 60, proc)
        r = Router(proc, port, settings, tmp / "router.log")
        wait_worker(r.url, OPERATOR)
        yield r
    finally:
        stop_process(proc)
        drop_topics(settings)


def _route_head(length: int) -> bytes:
    return (f"POST /v1/route HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {CLIENT}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n").encode()


def _closed(s: socket.socket, timeout: float) -> bool:
    s.settimeout(timeout)
    try:
        while data := s.recv(65536):
            if data.startswith(b"HTTP/1.1 "):
                return True  # answered (and closed after)
        return True
    except TimeoutError:
        return False
    except OSError:
        return True


@pytest.mark.timeout(240)
def test_trickled_bodies_do_not_take_every_connection(defaults_router: Router) -> None:
    """1,100 connections that send their headers and then trickle their bodies, against a
    1,024-fd process: /healthz, /readyz and a real route still answer."""
    r = defaults_router
    conns: list[socket.socket] = []
    evicted_before = r.metric(r'kvstream_http_rejected_total\{limit="connections"\}')
    try:
        for _ in range(1100):
            s = socket.create_connection(("127.0.0.1", r.port), timeout=5)
            s.sendall(_route_head(1000) + b'{"token_ids": [')
            conns.append(s)
        probes = {"/healthz": 0, "/readyz": 0}
        for i in range(40):
            for s in conns[i * 20 : i * 20 + 20]:  # the trickle goes on
                try:
                    s.send(b"1,")
                except OSError:
                    pass
            for path in probes:
                try:
                    probes[path] += httpx.get(r.url + path, timeout=5).status_code == 200
                except httpx.TransportError:
                    pass
        routed = httpx.post(r.url + "/v1/route", json={"token_ids": TOKENS, "query_only": True},
                            headers=auth(CLIENT), timeout=10)
        evicted = r.metric(r'kvstream_http_rejected_total\{limit="connections"\}') - evicted_before
        # The oldest trickles went first, and have been closed.
        closed = sum(_closed(s, 2) for s in conns[:50])
    finally:
        for s in conns:
            s.close()
    print(f"FAULTS http_trickle connections=1100 nofile={NOFILE} healthz_ok={probes['/healthz']}/40 "
          f"readyz_ok={probes['/readyz']}/40 route={routed.status_code} evicted={evicted:.0f} oldest_closed={closed}/50")
    assert probes == {"/healthz": 40, "/readyz": 40}
    assert routed.status_code == 200 and routed.json()["worker_id"] == 1
    assert evicted >= 1100 - 1024 and closed == 50


@pytest.mark.timeout(240)
def test_buffered_bodies_have_a_total_budget(defaults_router: Router) -> None:
    """24 overlapping 15 MiB bodies: the budget (64 MiB) takes 4, the rest are 429 before
    any byte of theirs is read; what a request held is given back when it ends."""
    r = defaults_router
    mib = 1024 * 1024
    before = hwm_mib(r.proc.pid)
    held: list[socket.socket] = []
    refused = 0
    try:
        for _ in range(24):
            s = raw_request(r.port, _route_head(15 * mib))
            try:
                s.sendall(b'{"token_ids": [' + b"1," * (7 * mib))  # 14 MiB of 15, the rest later
            except OSError:
                pass  # answered and closed while sending
            s.settimeout(0.5)
            try:
                status = read_status(s)
            except TimeoutError:
                held.append(s)  # reading: the request holds its 15 MiB
                continue
            assert status == 429, status
            refused += 1
            s.close()
        grew = hwm_mib(r.proc.pid) - before
        taken = len(held)
    finally:
        for s in held:
            s.close()
    # Given back: a large body is read and routed (a real prompt of 2^20 tokens, 11 MB;
    # with the 4 held bodies it would not fit the budget).
    time.sleep(0.5)
    body = b'{"token_ids": [' + b"4000000000," * ((1 << 20) - 1) + b'4000000000], "query_only": true}'
    with raw_request(r.port, _route_head(len(body)) + body, timeout=60) as s:
        after = read_status(s)
    budget = r.metric(r'kvstream_http_rejected_total\{limit="body_budget"\}')
    print(f"FAULTS http_body_budget bodies=24 size_mib=15 taken={taken} refused_429={refused} "
          f"peak_rss_growth_mib={grew:.0f} after_release={after}")
    assert taken == 4 and refused == 20 and budget >= 20
    assert after == 200
    assert grew < 4 * 15 + 48, grew  # the 4 bodies taken, not 24


@pytest.mark.timeout(60)
def test_probes_answer_when_every_connection_is_busy_with_a_whole_request() -> None:
    """Connections busy with whole requests cannot be evicted; the ones kept for probes
    still serve /healthz and /readyz, and refuse anything else with 503."""
    import asyncio

    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from kvstream.replica.http_limits import HttpLimits, guarded_protocol

    release = threading.Event()

    async def slow(_request) -> JSONResponse:
        while not release.is_set():
            await asyncio.sleep(0.02)
        return JSONResponse({"slow": True})

    async def ok(_request) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    app = Starlette(routes=[Route("/slow", slow), Route("/healthz", ok), Route("/readyz", ok)])
    limits = HttpLimits(max_connections=4, probe_connections=2)
    rejected: list[str] = []
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(
        app, host="127.0.0.1", port=port, log_level="warning", access_log=False,
        http=guarded_protocol(limits, rejected.append),
        limit_concurrency=limits.max_connections + limits.probe_connections + 1,
    ))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    busy: list[socket.socket] = []
    try:
        wait_http(f"http://127.0.0.1:{port}/healthz", 20)
        for _ in range(4):  # every routing connection is busy with a whole request
            busy.append(raw_request(port, b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n"))
        time.sleep(0.3)
        answers = [httpx.get(f"http://127.0.0.1:{port}{p}", timeout=5).status_code for p in ("/healthz", "/readyz") * 5]
        other = httpx.get(f"http://127.0.0.1:{port}/slow", timeout=5).status_code
        release.set()
        for s in busy:
            assert read_status(s) == 200  # none of them was cut
    finally:
        release.set()
        for s in busy:
            s.close()
        server.should_exit = True
        t.join(10)
    assert answers == [200] * 10 and other == 503 and "connections" in rejected


# -- 5: a snapshot written for another topic ----------------------------------------------


def _replay_rebuild(settings: Settings, out: Path) -> str:
    """``kvstream replay rebuild --write-snapshot``, the real CLI, as an operator runs it."""
    import subprocess

    from tests.faults.helpers import KVSTREAM, ROOT, router_env

    proc = subprocess.run(
        [str(KVSTREAM), "replay", "rebuild", "--bootstrap", str(settings.bootstrap), "--topic-prefix",
         settings.topics.prefix, "--at", "now", "--write-snapshot", str(out)],
        env=router_env(settings), capture_output=True, text=True, timeout=120, cwd=ROOT, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.timeout(180)
def test_a_snapshot_of_another_topic_is_refused(kafka_topics_factory, tmp_path: Path) -> None:
    from kvstream.replica.snapshot import SnapshotStore

    x, y = kafka_topics_factory(events_partitions=4), kafka_topics_factory(events_partitions=4)
    wx, wy = FakeWorkerLog(81), FakeWorkerLog(82)
    produce(x, [(81, wx.batch(wx.cleared(), wx.stored(list(range(16 * 6)))))])
    produce(y, [(82, wy.batch(wy.cleared(), wy.stored(list(range(16 * 3)))))])
    # Log-clock ticks on every partition of Y, so that X's offsets all lie within Y's log
    # (the case where nothing else betrays the foreign snapshot).
    p = Producer(producer_config(y))
    for part in range(4):
        for _ in range(3):
            p.produce(y.topics.name("events"), None, partition=part, headers=[(TICK_HEADER, b"")])
    assert p.flush(30) == 0
    snap = tmp_path / "from-x"
    _replay_rebuild(x, snap)
    store = SnapshotStore(snap, read_only=True)
    meta = store.latest_meta()[0]
    store.close()
    r = start(y, snapshot_dir=snap)
    try:
        wait_caught_up(r, y)
        with r.lock:
            assert 81 not in r.fold.workers and not r.router.knows(81)
            assert r.router.worker_blocks(82) > 0
        assert r.metrics.snapshot_fallbacks.labels(skipped="foreign")._value.get() == 1
        assert any("written for topic" in n for n in r.recovery_notes), r.recovery_notes
    finally:
        r.stop()
    agrees_with_log(r, y)
    # The snapshot records which topic it is of: name and id.
    from kvstream.kafka.topics import topic_id

    assert meta.topic == x.topics.name("events") and meta.topic_id == topic_id(x, meta.topic) is not None


# -- 6: unbounded blocks ------------------------------------------------------------------


def _flood(wid: int, epoch: int, events: int, per_event: int, base: int) -> EventBatch:
    """A rogue's chain of ``events`` stores of ``per_event`` blocks (a batch each would
    exceed the record size: the caller splits)."""
    out, parent = [Cleared(wid, 0, D, epoch, 0)], None
    for i in range(events):
        hashes = tuple(range(base + i * per_event, base + (i + 1) * per_event))
        out.append(Stored(wid, 0, D, epoch, i + 1, parent, hashes, hashes))
        parent = hashes[-1]
    return EventBatch(wid, epoch, 60_000, tuple(out))


def _produce_split(settings: Settings, batch: EventBatch, partition: int | None = None) -> None:
    """One record per event (lz4: a 65,536-block store of sequential hashes compresses far
    below the broker's message size)."""
    p = Producer(producer_config(settings, **{"compression.type": "lz4", "message.max.bytes": 4_000_000}))
    for ev in batch.events:
        value = CODEC.encode(EventBatch(batch.worker_id, batch.epoch, batch.lease_ms, (ev,)))
        kw = {} if partition is None else {"partition": partition}
        p.produce(settings.topics.name("events"), value, key=worker_key(batch.worker_id), **kw)
        p.poll(0)
    assert p.flush(60) == 0


@pytest.mark.timeout(240)
def test_block_floods_meet_the_default_worker_limit_and_the_fleet_budget(kafka_topics: Settings) -> None:
    # Defaults: a rogue stores 17 x 65,536 blocks (each event under max_blocks_per_event).
    per_event = 65_536
    _produce_split(kafka_topics, _flood(90, 1, 17, per_event, 10**9))
    # The fleet budget, scaled (max_blocks_per_partition 4,000): 3 workers of 1,500 on
    # one partition; the third does not fit.
    budget = _with_fold(kafka_topics, max_blocks_per_partition=4_000)
    for wid in (91, 92, 93):
        _produce_split(kafka_topics, _flood(wid, 1, 3, 500, wid * 10**6), partition=3)
    r, b = start(kafka_topics), start(budget)
    try:
        wait_caught_up(r, kafka_topics)
        wait_caught_up(b, kafka_topics)
        with r.lock:
            rogue = r.router.worker_blocks(90)
            worker_limit = r.fold.counters[WORKER_FULL]
        with b.lock:
            fleet = {wid: b.router.worker_blocks(wid) for wid in (90, 91, 92, 93)}
            fleet_limit = b.fold.counters[PARTITION_FULL]
    finally:
        r.stop()
        b.stop()
    print(f"FAULTS block_flood offered={17 * per_event} held={rogue} worker_block_limit={worker_limit} "
          f"partition_budget=4000 held={fleet} partition_block_limit={fleet_limit}")
    assert rogue == DEFAULT_BLOCKS_PER_WORKER == 16 * per_event and worker_limit == 1
    # (the rogue's 17 stores do not fit the scaled budget either)
    assert fleet == {90: 0, 91: 1_500, 92: 1_500, 93: 1_000} and fleet_limit == 1 + 17
    agrees_with_log(r, kafka_topics)
    agrees_with_log(b, budget)


# -- 7: event ids taken ahead, and across a restart ----------------------------------------


def _take_ids(settings: Settings, pub, wid: int, first: int, n: int) -> None:
    """Another producer takes the worker's next ``n`` event ids (its epoch and key),
    storing blocks the worker does not have."""
    rogue = tuple(
        Stored(wid, 0, D, pub.epoch, first + i, None, (777_000 + i,), (777_000 + i,)) for i in range(n)
    )
    _produce_raw(settings, [EventBatch(wid, pub.epoch, 60_000, rogue)])


@pytest.mark.timeout(120)
def test_event_ids_taken_ahead_are_conflicts_not_duplicates(kafka_topics: Settings) -> None:
    pub, cons = publisher(kafka_topics, 76, listen_control=True)
    r = start(kafka_topics, resync_min_interval_s=0.0)
    try:
        store(cons, 100, 4)
        assert pub.flush(30) == 0
        wait_caught_up(r, kafka_topics)
        _take_ids(kafka_topics, pub, 76, _last_event_id(kafka_topics, 76, pub.epoch) + 1, 20)
        first = pub.epoch
        for i in range(20):  # the worker's own 20 events with those ids
            chain(cons, 200 + 10 * i, 1)
        assert pub.flush(30) == 0
        until(lambda: pub.stats.resyncs >= 1, "the worker's resync", tick=lambda: pub.poll(cons))
        assert pub.flush(30) == 0 and pub.epoch > first
        wait_caught_up(r, kafka_topics)
        with r.lock:
            conflicts, duplicates = r.fold.counters[ID_CONFLICT], r.fold.counters[DUPLICATE]
            healed = blocks(r.fold, 76)
    finally:
        r.stop()
        pub.close()
    print(f"FAULTS ids_taken_ahead=20 conflicts={conflicts} hidden_as_duplicates={duplicates}")
    assert conflicts == 20 and duplicates == 0
    assert healed == epoch_truth(kafka_topics, 76, pub.epoch) and not {h for _, _, h in healed} & set(range(777_000, 777_020))
    agrees_with_log(r, kafka_topics)


@pytest.mark.timeout(180)
def test_a_replica_restarted_between_a_rogue_record_and_the_real_one_sees_the_conflict(
    kafka_topics: Settings, tmp_path: Path
) -> None:
    pub, cons = publisher(kafka_topics, 77, listen_control=True)
    snap = tmp_path / "snap"
    r = start(kafka_topics, snapshot_dir=snap, resync_min_interval_s=0.0)
    try:
        store(cons, 100, 4)
        assert pub.flush(30) == 0
        wait_caught_up(r, kafka_topics)
        _take_ids(kafka_topics, pub, 77, _last_event_id(kafka_topics, 77, pub.epoch) + 1, 1)
        wait_caught_up(r, kafka_topics)
    finally:
        r.stop()  # a final snapshot: the rogue record is in it
    first = pub.epoch
    chain(cons, 300, 2)  # the real event with that id, while no replica runs
    assert pub.flush(30) == 0
    r2 = start(kafka_topics, snapshot_dir=snap, resync_min_interval_s=0.0)
    try:
        until(lambda: r2.fold.counters[ID_CONFLICT] == 1, "the conflict seen after the restart")
        until(lambda: pub.stats.resyncs >= 1, "the worker's resync", tick=lambda: pub.poll(cons))
        assert pub.flush(30) == 0 and pub.epoch > first
        wait_caught_up(r2, kafka_topics)
        with r2.lock:
            healed = blocks(r2.fold, 77)
    finally:
        r2.stop()
        pub.close()
    assert healed == epoch_truth(kafka_topics, 77, pub.epoch) and 777_000 not in {h for _, _, h in healed}


# -- 7: docs behind the operator token; settings errors that keep secrets ------------------


def test_docs_need_the_operator_token(defaults_router: Router) -> None:
    r = defaults_router
    for path in ("/docs", "/openapi.json"):
        assert httpx.get(r.url + path, timeout=10).status_code == 401, path
        assert httpx.get(r.url + path, headers=auth(CLIENT), timeout=10).status_code == 401, path
        assert httpx.get(r.url + path, headers=auth(OPERATOR), timeout=10).status_code == 200, path
    schema = httpx.get(r.url + "/openapi.json", headers=auth(OPERATOR), timeout=10).json()
    assert "/v1/route" in schema["paths"]


@pytest.mark.timeout(120)
def test_kafka_option_errors_are_one_line_without_the_secret(kafka_bootstrap: str) -> None:
    import subprocess

    from tests.faults.helpers import KVSTREAM, ROOT, router_env

    secret = "918273645546372819"
    for options, says in (
        (f'{{"sasl.password": {secret}}}', "kafka_options.sasl.password"),  # a number in TOML/JSON
        (f'{{"sasl.mechanism": "{secret}", "security.protocol": "SASL_PLAINTEXT"}}', "Unsupported SASL mechanism"),
        ('{"no.such.option": "1"}', 'No such configuration property: "no.such.option"'),
    ):
        env = router_env(Settings(bootstrap=kafka_bootstrap)) | {"KVSTREAM_KAFKA_OPTIONS": options}
        out = subprocess.run([str(KVSTREAM), "router", "--bootstrap", kafka_bootstrap], env=env, cwd=ROOT,
                             capture_output=True, text=True, timeout=60, check=False)
        text = out.stdout + out.stderr
        assert out.returncode != 0 and says in text, text
        assert secret not in text and "Traceback" not in text, text
        assert len([ln for ln in out.stderr.splitlines() if ln.startswith("Error:")]) == 1, text


# -- 7: the snapshot directory deleted under a running replica ----------------------------


@pytest.mark.timeout(120)
def test_a_deleted_snapshot_directory_fails_commits_and_is_made_again(kafka_topics: Settings, tmp_path: Path) -> None:
    import shutil

    from kvstream.replica.snapshot import SnapshotStore

    snap = tmp_path / "snap"
    w = FakeWorkerLog(78, lease_ms=10**9)
    produce(kafka_topics, [(78, w.batch(w.cleared(), w.stored(list(range(16 * 4)))))])
    r = start(kafka_topics, snapshot_dir=snap, snapshot_every_records=1, snapshot_every_s=0.2)
    try:
        wait_caught_up(r, kafka_topics)
        until(lambda: r.snapshotter.base is not None, "a first generation")
        shutil.rmtree(snap)
        produce(kafka_topics, [(78, w.batch(w.stored(list(range(16 * 8)), start_block=4)))])
        until(lambda: r.metrics.snapshot_write_failures._value.get() >= 1, "the failed commit counted")
        produce(kafka_topics, [(78, w.batch(w.stored(list(range(16 * 9)), start_block=8)))])
        wait_caught_up(r, kafka_topics)
        failed_at = r.snapshotter._bad_gen
        until(lambda: snap.is_dir() and r.snapshotter.base.gen > failed_at and not r.snapshotter._failed.is_set(),
              "a generation in the directory made again")
        failures = r.metrics.snapshot_write_failures._value.get()
    finally:
        r.stop()
    from tests.replica.test_snapshot import restore

    store = SnapshotStore(snap, read_only=True)
    try:
        fold, _, _ = restore(store)  # what a restart would load: the whole log
    finally:
        store.close()
    assert fold.router.worker_blocks(78) == 9 and failures >= 1
    print(f"FAULTS snapshot_dir_deleted failed_commits={failures:.0f} blocks_after_restart=9")


# -- 7: resyncs found in the log's history ------------------------------------------------


def _requests_by(settings: Settings, requester: str, wait_s: float = 4.0) -> list[dict]:
    from kvstream.events.codec import AvroCodec
    from tests.replica.test_replica_kafka import read_all

    codec = AvroCodec()
    records = [codec.decode(m.value())[1] for m in read_all(settings, "control", timeout=wait_s, want=10**6)]
    return [r for r in records if r["requester"] == requester]


@pytest.mark.timeout(180)
def test_a_fresh_replica_asks_only_for_resyncs_the_log_has_not_healed(kafka_topics: Settings) -> None:
    pub, cons = publisher(kafka_topics, 79, listen_control=True)
    live = start(kafka_topics, resync_min_interval_s=0.0)
    try:
        store(cons, 100, 4)
        assert pub.flush(30) == 0
        wait_caught_up(live, kafka_topics)
        # A gap (a lost batch), healed at once by the worker's resync.
        gap = Stored(79, 0, D, pub.epoch, _last_event_id(kafka_topics, 79, pub.epoch) + 3, None, (4242,), (4242,))
        _produce_raw(kafka_topics, [EventBatch(79, pub.epoch, 60_000, (gap,))])
        until(lambda: pub.stats.resyncs == 1, "the worker's resync", tick=lambda: pub.poll(cons))
        assert pub.flush(30) == 0
        # Worker 83 has a gap nobody healed (it never answers).
        w = FakeWorkerLog(83, lease_ms=10**9)
        produce(kafka_topics, [(83, w.batch(w.cleared(), w.stored(list(range(32))))),
                               (83, EventCodec().encode(EventBatch(83, w.epoch, 10**9, (
                                   Stored(83, 0, D, w.epoch, 9, None, (4343,), (4343,)),))))])
        wait_caught_up(live, kafka_topics)
    finally:
        live.stop()
    fresh = start(kafka_topics, resync_min_interval_s=0.0)
    try:
        wait_caught_up(fresh, kafka_topics)
        until(lambda: fresh.metrics.resync_requests._value.get() >= 1, "the unhealed resync")
        asked = [r["worker_id"] for r in _requests_by(kafka_topics, fresh.replica_id)]
        assert asked == [83], asked  # not 79: its gap was healed long ago
        healed = fresh.metrics.resyncs_healed._value.get()
    finally:
        fresh.stop()
        pub.close()
    print(f"FAULTS history_resyncs asked={asked} healed_not_asked={healed:.0f}")
    assert healed >= 1


# -- 7: two replicas given the same replica_id --------------------------------------------


@pytest.mark.timeout(120)
def test_two_replicas_with_one_replica_id_are_refused(kafka_topics: Settings) -> None:
    w = FakeWorkerLog(84, lease_ms=10**9)
    produce(kafka_topics, [(84, w.batch(w.cleared(), w.stored(list(range(64)))))])
    given_up: list[str] = []
    from kvstream.replica.replica import Replica, ReplicaOptions

    first = start(kafka_topics, replica_id="router-a")
    time.sleep(0.01)  # strictly later
    second = Replica(kafka_topics, ReplicaOptions(replica_id="router-a", tick_interval_s=3600.0), on_fatal=given_up.append)
    second.start()
    try:
        assert second.wait_ready(60)
        wait_caught_up(first, kafka_topics)
        wait_caught_up(second, kafka_topics)
        # Both route (each publishes its load ops); each reads the other's.
        for i in range(3):
            first.route(list(range(64)), request_id=f"a-{i}")
            second.route(list(range(64)), request_id=f"b-{i}")
        until(lambda: second.fatal is not None, "the later instance refused")
        until(lambda: first.metrics.replica_id_conflicts._value.get() >= 1, "the earlier one sees it")
        assert first.fatal is None and first.ready and not second.ready
        assert given_up and "replica_id 'router-a'" in given_up[0]
    finally:
        second.stop()
        first.stop()
    print(f"FAULTS same_replica_id later_gave_up={second.fatal is not None} earlier_serving={first.fatal is None}")


# -- 1 (the limit's part): phantoms cannot crowd out an honest worker ---------------------


@pytest.mark.timeout(240)
def test_phantoms_cannot_crowd_out_an_honest_worker(kafka_topics: Settings, tmp_path: Path) -> None:
    """5,000 phantoms (`cleared` only, made-up ids) fill every partition past the default
    limit (1,024 workers each); an honest worker that then starts, and stores blocks, is
    admitted in place of the phantom seen least recently, and stays across a restart
    from a snapshot while more phantoms come."""
    def phantoms(first: int, n: int) -> list[EventBatch]:
        return [EventBatch(wid, 1, 10**9, (Cleared(wid, 0, D, 1, 0),)) for wid in range(first, first + n)]

    snap = tmp_path / "snap"
    _produce_raw(kafka_topics, phantoms(100_000, 5_000))
    r = start(kafka_topics, snapshot_dir=snap)
    pub, cons = publisher(kafka_topics, 85, listen_control=False)
    try:
        wait_caught_up(r, kafka_topics)
        store(cons, 100, 6)
        assert pub.flush(30) == 0
        wait_caught_up(r, kafka_topics)
        with r.lock:
            assert blocks(r.fold, 85) == epoch_truth(kafka_topics, 85, pub.epoch) and len(blocks(r.fold, 85)) == 6
            displaced = r.fold.counters[DISPLACED]
            refused = r.fold.counters["partition_worker_limit"]
    finally:
        r.stop()
    _produce_raw(kafka_topics, phantoms(200_000, 1_000))
    chain(cons, 200, 3)
    assert pub.flush(30) == 0
    r2 = start(kafka_topics, snapshot_dir=snap)
    try:
        wait_caught_up(r2, kafka_topics)
        with r2.lock:
            held = blocks(r2.fold, 85)
            per_partition: dict[int, int] = {}
            for wlog in r2.fold.workers.values():
                per_partition[wlog.partition] = per_partition.get(wlog.partition, 0) + 1
    finally:
        r2.stop()
        pub.close()
    print(f"FAULTS phantoms=6000 default_limit=1024 honest_admitted=True displaced={displaced} refused={refused} "
          f"per_partition={sorted(per_partition.values())}")
    assert refused == 0 and displaced >= 5_000 - 4 * 1024
    assert held == epoch_truth(kafka_topics, 85, pub.epoch) and len(held) == 9
    assert max(per_partition.values()) == 1024
    agrees_with_log(r2, kafka_topics)  # restored from a snapshot: the same phantoms displaced


# -- 1 (the candidates' part): a phantom never wins a route -------------------------------


@pytest.mark.timeout(300)
def test_phantoms_never_win_a_route(kafka_topics: Settings, tmp_path: Path) -> None:
    """20,000 `cleared` records from made-up ids (lease 2^63-1), never registered: no
    uncached prompt routes to one of them, before or after a restart; an honest worker
    that registers (as `kvstream worker` does) is admitted and wins them all."""
    from fastapi.testclient import TestClient

    from kvstream.events.registration import Registration
    from kvstream.replica.service import create_app
    from kvstream.worker.announce import WorkerAnnouncer

    phantoms = range(300_000, 320_000)
    lease = (1 << 63) - 1
    _produce_raw(kafka_topics, [EventBatch(w, 1, lease, (Cleared(w, 0, D, 1, 0),)) for w in phantoms])
    snap = tmp_path / "snap"
    rng = __import__("random").Random(28)

    def uncached(client: TestClient, n: int = 40) -> list[httpx.Response]:
        return [client.post("/v1/route", json={"token_ids": [rng.randrange(50_000) for _ in range(64)],
                                               "request_id": f"p{rng.getrandbits(48):x}"}) for _ in range(n)]

    r = start(kafka_topics, snapshot_dir=snap)
    pub, cons = publisher(kafka_topics, 77, listen_control=False)
    try:
        wait_caught_up(r, kafka_topics)
        client = TestClient(create_app(r))
        before = uncached(client)
        # No registered worker yet: refused, with the reason, never a phantom.
        assert {a.status_code for a in before} == {503}
        assert "no registered worker" in before[0].json()["error"]
        announcer = WorkerAnnouncer(kafka_topics, Registration(77, None, (), (), 16, (0,), "synthetic", None,
                                                              pub.epoch, int(time.time() * 1000)))
        announcer.announce()
        announcer.close()
        store(cons, 100, 6)
        assert pub.flush(30) == 0
        wait_caught_up(r, kafka_topics)
        with r.lock:
            assert len(blocks(r.fold, 77)) == 6 and len(r.fold.workers) > 4_000  # the phantoms are folded
        live = uncached(client)
        assert all(a.status_code == 200 for a in live), live[0].text
        won = {a.json()["worker_id"] for a in live}
    finally:
        r.stop()
    assert won == {77}
    _produce_raw(kafka_topics, [EventBatch(w, 1, lease, (Cleared(w, 0, D, 1, 0),)) for w in range(400_000, 401_000)])
    chain(cons, 200, 3)
    assert pub.flush(30) == 0
    r2 = start(kafka_topics, snapshot_dir=snap)
    try:
        wait_caught_up(r2, kafka_topics)
        after = uncached(TestClient(create_app(r2)))
        assert all(a.status_code == 200 for a in after), after[0].text
        won_after = {a.json()["worker_id"] for a in after}
        assert r2.registry.worker_ids() == {77}
    finally:
        r2.stop()
        pub.close()
    assert won_after == {77}
    print("FAULTS phantoms=21000 registered=1 uncached_routes=80 to_phantoms=0 before_registration=503x40")
