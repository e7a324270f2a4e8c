"""Issue 27: one record must never stop a replica, and a burst must never make every
replica refuse routing at once.

1. A hypothesis fuzzer of everything a record carries besides its value — key (absent,
   empty, huge, binary, another worker's) and headers (kvstream's worker status absent,
   null, huge, nested 100,000 deep, binary, not an object, given twice; a tick header;
   unknown headers) — on otherwise valid batches, through a live replica, the same
   replica restarted on its snapshots, and a fresh one. Each stays up and ready, every
   batch's events are applied (headers are advisory), every bad header is counted and
   dead-lettered by reference, and all three end equal to the reference fold.
2. 200,000 one-block records at once behind a live replica: it keeps routing (each
   decision marked stale, /readyz 200 with the reason), and catches up.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter

import orjson
import pytest
from confluent_kafka import Producer
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstream.events.model import STATUS_HEADER
from kvstream.kafka.config import producer_config
from kvstream.replica.authority import KEY_MISMATCH
from kvstream.events.model import TICK_HEADER
from kvstream.replica.fold import BAD_HEADER
from kvstream.replica.replica import Replica, ReplicaOptions
from kvstream.replica.service import create_app
from kvstream.settings import Settings
from kvstream.worker.announce import register_synthetic

from tests.faults.helpers import agrees_with_log, comparable
from tests.replica.helpers import FakeWorkerLog
from tests.replica.test_replica_kafka import read_all, wait_caught_up

pytestmark = [pytest.mark.faults, pytest.mark.kafka]

TOKENS = list(range(16 * 3))
FIRST = 1 << 30
EXAMPLES = 300

# (label, headers, whether kvstream must call them bad). A status that is valid JSON
# but not an object is bad too: /v1/workers shows an object per worker.
NESTED = b"[" * 100_000 + b"]" * 100_000
_TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=20)
BAD_STATUS = st.one_of(
    st.just(("status null", None)),
    st.just(("status nested 100k", NESTED)),
    st.just(("status nested 2k", b'{"a":' * 2000 + b"1" + b"}" * 2000)),
    st.just(("status huge", b'{"issue": "' + b"x" * 200_000 + b'"}')),
    st.binary(min_size=1, max_size=64).filter(lambda b: _not_json_object(b)).map(lambda b: ("status binary", b)),
    st.sampled_from([b"[]", b"1", b'"x"', b"null", b"true"]).map(lambda b: ("status not an object", b)),
)
GOOD_STATUS = st.dictionaries(_TEXT, _TEXT, max_size=3).map(lambda d: ("status ok", orjson.dumps(d)))
OTHER = st.one_of(
    st.tuples(_TEXT.filter(lambda k: k not in (STATUS_HEADER, TICK_HEADER)), st.none() | st.binary(max_size=300)),
)


def _not_json_object(raw: bytes) -> bool:
    try:
        return not isinstance(json.loads(raw), dict)
    except (ValueError, RecursionError):
        return True


@st.composite
def headers_case(draw) -> tuple[str, list | None, bool]:
    """Headers of one record: a label, the headers, and whether kvstream must reject them."""
    kind = draw(st.sampled_from(["none", "empty", "bad", "good", "twice", "others"]))
    others = draw(st.lists(OTHER, max_size=3))
    if kind == "none":
        return "no headers", None, False
    if kind == "empty":
        return "empty headers", [], False
    if kind == "others":
        return "unknown headers", others, False
    if kind == "good":
        label, raw = draw(GOOD_STATUS)
        return label, [*others, (STATUS_HEADER, raw)], False
    if kind == "twice":
        (_, a), (_, b) = draw(GOOD_STATUS), draw(GOOD_STATUS)
        return "status twice", [(STATUS_HEADER, a), *others, (STATUS_HEADER, b)], True
    label, raw = draw(BAD_STATUS)
    return label, [*others, (STATUS_HEADER, raw)], True


KEYS = st.one_of(
    st.just(("key ok", "ok")), st.just(("no key", None)), st.just(("empty key", b"")),
    st.just(("huge key", b"k" * 100_000)), st.binary(min_size=1, max_size=16).map(lambda b: ("binary key", b)),
)


def fuzz_cases() -> list[tuple[str, str, object, list | None, bool]]:
    out: list = []

    @settings(max_examples=EXAMPLES, database=None, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(headers_case(), KEYS)
    def collect(h, k) -> None:
        out.append((h[0], k[0], k[1], h[1], h[2]))

    collect()
    return out


def _produce_cases(s: Settings, cases) -> tuple[list[int], int]:
    """One worker per case (cleared + stored, valid); returns the worker ids and how
    many records kvstream must count as bad."""
    p = Producer(producer_config(s, **{"message.max.bytes": 1_000_000}))
    topic = s.topics.name("events")
    wids, bad = [], 0
    for i, (_, _, key, headers, is_bad) in enumerate(cases):
        w = FakeWorkerLog(FIRST + i)
        wids.append(w.worker_id)
        bad += is_bad
        value = w.batch(w.cleared(), w.stored(TOKENS))
        key = w.worker_id.to_bytes(8, "big") if key == "ok" else key
        p.produce(topic, value, key=key, headers=headers)
        p.poll(0)
    assert p.flush(60) == 0
    return wids, bad


def _up(r: Replica) -> None:
    assert r.fatal is None, r.fatal
    assert r.wait_ready(60), r.not_ready_reasons()


@pytest.mark.timeout(600)
def test_poison_keys_and_headers_stop_no_replica(kafka_topics_factory, tmp_path) -> None:
    s: Settings = kafka_topics_factory(events_partitions=3)
    cases = fuzz_cases()
    # The two records of the issue come first, whatever hypothesis draws.
    cases[:0] = [("status null", "key ok", "ok", [(STATUS_HEADER, None)], True),
                 ("status nested 100k", "key ok", "ok", [(STATUS_HEADER, NESTED)], True)]
    opts = dict(tick_interval_s=3600.0, snapshot_every_records=50, thread_max_failures=2, thread_backoff_s=0.2)
    live = Replica(s, ReplicaOptions(snapshot_dir=tmp_path / "snap", **opts))
    live.start()
    _up(live)
    wids, bad = _produce_cases(s, cases)
    try:
        wait_caught_up(live, s, timeout=120)
        time.sleep(1.0)  # what a failing ingest thread would need to give up (2 failures)
        _up(live)
        with live.lock:
            known = {w for w in wids if live.router.knows(w)}
            counters = Counter(live.fold.counters)
            status = dict(live._worker_status)
        # Headers are advisory: every batch applied whatever its headers; a key other
        # than the worker's is refused by the log's authority (check_key, the default).
        keyed = {FIRST + i for i, case in enumerate(cases) if case[1] == "key ok"}
        assert known == keyed
        assert counters[BAD_HEADER] == bad > 0
        assert counters[KEY_MISMATCH] == len(wids) - len(keyed) > 0
        good_status = [(FIRST + i, json.loads(h[-1][1])) for i, (label, key, _, h, _) in enumerate(cases)
                       if label == "status ok" and key == "key ok"]
        assert good_status and all(status[w] == doc for w, doc in good_status)
        reference = agrees_with_log(live, s)
        rejected = sum(1 for _, key, _, _, is_bad in cases if is_bad or key != "key ok")
        dlq = read_all(s, "dlq", timeout=60, want=rejected)
        assert len(dlq) == rejected
        by_reference = [m for m in dlq if "kvstream-dlq-reference" in dict(m.headers())]
        assert len(by_reference) == bad, "a record with a bad header is dead-lettered by reference"
        assert all(json.loads(m.value())["reason"].startswith(BAD_HEADER) for m in by_reference)
        assert all(dict(m.headers())["kvstream-error"].startswith(KEY_MISMATCH.encode())
                   for m in dlq if m not in by_reference)
    finally:
        live.stop()
    for name, snapshot_dir in (("restarted", tmp_path / "snap"), ("fresh", None)):
        r = Replica(s, ReplicaOptions(snapshot_dir=snapshot_dir, **opts))
        r.start()
        try:
            _up(r)
            wait_caught_up(r, s, timeout=120)
            time.sleep(1.0)
            _up(r)
            with r.lock:
                assert comparable(r.fold) == comparable(reference), f"the {name} replica differs"
        finally:
            r.stop()


BURST = 200_000


@pytest.mark.timeout(600)
def test_burst_keeps_a_live_replica_routing(kafka_topics_factory) -> None:
    s: Settings = kafka_topics_factory(events_partitions=4)
    real = FakeWorkerLog(7)
    register_synthetic(s, [7])  # the real worker registers; the poison's ids never do
    p = Producer(producer_config(s, **{"linger.ms": 50, "batch.num.messages": 10_000}))
    topic = s.topics.name("events")
    p.produce(topic, real.batch(real.cleared(), real.stored(TOKENS)), key=(7).to_bytes(8, "big"))
    assert p.flush(30) == 0
    r = Replica(s, ReplicaOptions(tick_interval_s=3600.0))
    r.start()
    assert r.wait_ready(60)
    # The burst: one-block stores of 1,000 workers (valid, each on its own key).
    workers = [FakeWorkerLog(1000 + i) for i in range(1000)]
    burst = [(w.worker_id, w.batch(w.cleared())) for w in workers]
    burst += [(w.worker_id, w.batch(w.stored(list(range(16 * j, 16 * (j + 1))), start_block=0)))
              for j in range(BURST // 1000 - 1) for w in workers]
    statuses: Counter[int] = Counter()
    stale_seen: list[dict] = []
    readyz: Counter[int] = Counter()
    done = threading.Event()
    with TestClient(create_app(r)) as client:
        def route_loop() -> None:
            while not done.is_set():
                resp = client.post("/v1/route", json={"token_ids": TOKENS, "query_only": True})
                statuses[resp.status_code] += 1
                if resp.status_code == 200 and "stale" in resp.json():
                    stale_seen.append(resp.json()["stale"])
                readyz[client.get("/readyz").status_code] += 1
                time.sleep(0.01)

        t = threading.Thread(target=route_loop)
        t.start()
        try:
            for i, (wid, value) in enumerate(burst):
                while True:
                    try:
                        p.produce(topic, value, key=wid.to_bytes(8, "big"))
                        break
                    except BufferError:
                        p.poll(0.05)
                if i % 10_000 == 0:
                    p.poll(0)
            assert p.flush(60) == 0
            wait_caught_up(r, s, timeout=300)
            deadline = time.monotonic() + 10
            while r.staleness() is not None and time.monotonic() < deadline:
                time.sleep(0.1)
        finally:
            done.set()
            t.join(30)
        assert set(statuses) == {200}, f"a live replica refused routing during a burst: {dict(statuses)}"
        assert set(readyz) == {200}, dict(readyz)
        assert r.staleness() is None, "caught up, yet still marked stale"
        final = client.post("/v1/route", json={"token_ids": TOKENS, "query_only": True}).json()
        assert "stale" not in final and final["worker_id"] == 7
    r.stop()
    assert stale_seen, "the replica never said it was behind"
    assert all(st["lag_records"] > 1000 for st in stale_seen)
