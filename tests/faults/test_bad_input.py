"""Issue 9 (5): a hypothesis fuzzer feeds tens of thousands of malformed records into the
events topic and malformed requests into the HTTP API of a running replica. Every bad
record lands in the DLQ with a reason (and is counted), every bad request gets a 4xx, the
replica keeps serving, and its index is exactly what the good records built."""

from __future__ import annotations

import hashlib
import json
import struct
import time
from collections import Counter

import pytest
from confluent_kafka import Producer
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstream.events.codec import EVENT_BATCH, MARKER, AvroCodec, EventCodec
from kvstream.kafka.config import producer_config
from kvstream.replica.fold import DECODE_ERROR, DUPLICATE
from kvstream.router.index import UNKNOWN_REMOVE
from kvstream.replica.replica import ReplicaOptions
from kvstream.replica.route_body import RouteRequest
from kvstream.replica.service import create_app
from kvstream.settings import FoldSettings, Settings
from kvstream.worker.announce import register_synthetic

from tests.faults.helpers import agrees_with_log, comparable
from tests.replica.helpers import FakeWorkerLog, new_fold
from tests.replica.test_replica_kafka import read_all, start, wait_caught_up

pytestmark = [pytest.mark.faults, pytest.mark.kafka, pytest.mark.slow]

CODEC = AvroCodec()
REAL = 51  # a healthy worker: its blocks must not move
FIRST_FUZZ_WORKER = 1 << 20
RECORDS_PER_EXAMPLE = 25
EXAMPLES = 1000  # 25,000 records
REQUESTS = 2500
TIERS = ["DEVICE", "HOST_PINNED", "DISK", "EXTERNAL"]
U64 = (1 << 64) - 1
I64 = st.integers(-(1 << 63), (1 << 63) - 1)


def _event(**kw) -> dict:
    ev = {"dp_rank": 0, "tier": "DEVICE", "event_id": 1, "kind": "STORED", "parent_hash": None,
          "block_hashes": struct.pack("<2Q", 11, 12), "tokens_hashes": struct.pack("<2Q", 1, 2)}
    ev.update(kw)
    return ev


def _packed(n: int) -> st.SearchStrategy[bytes]:
    return st.lists(st.integers(0, U64), min_size=n, max_size=n, unique=True).map(lambda v: struct.pack(f"<{len(v)}Q", *v))


# Valid Avro whose values no router may apply: each is exactly one bad event, so the
# record is rejected whole. Removes of blocks nobody holds are the one exception: the
# design counts and skips them (DESIGN.md §2), like duplicates, without a DLQ copy.
SKIPPED = "remove of unknown blocks"
IMPOSSIBLE: list[tuple[str, st.SearchStrategy[dict]]] = [
    ("unknown tier", st.builds(lambda: _event(tier="UNKNOWN"))),
    ("unknown kind", st.sampled_from(TIERS).map(lambda t: _event(tier=t, kind="UNKNOWN"))),
    ("dp_rank overflows u32", st.one_of(st.integers(1 << 32, (1 << 63) - 1), st.integers(-(1 << 63), -1)).map(lambda r: _event(dp_rank=r))),
    ("hashes not whole u64s", st.binary(min_size=1, max_size=63).filter(lambda b: len(b) % 8).map(lambda b: _event(block_hashes=b))),
    ("tokens/blocks mismatch", _packed(3).map(lambda b: _event(block_hashes=b))),
    ("stored without blocks", st.builds(lambda: _event(block_hashes=b"", tokens_hashes=b""))),
    ("removed with stored fields", I64.map(lambda p: _event(kind="REMOVED", parent_hash=p))),
    ("cleared with blocks", st.builds(lambda: _event(kind="CLEARED", tokens_hashes=b""))),
    ("parent loop", st.integers(0, U64 - 1).map(lambda h: _event(parent_hash=h - (1 << 64) if h >= 1 << 63 else h, block_hashes=struct.pack("<2Q", h, h + 1)))),
    ("repeated hash", st.integers(0, U64).map(lambda h: _event(block_hashes=struct.pack("<2Q", h, h)))),
    ("parent not held", I64.map(lambda p: _event(parent_hash=p))),
    (SKIPPED, _packed(2).map(lambda b: _event(kind="REMOVED", block_hashes=b, tokens_hashes=b""))),
]


def _impossible() -> st.SearchStrategy[tuple[str, bytes]]:
    def encode(pair: tuple[str, dict], lease: int, epoch: int) -> tuple[str, bytes]:
        label, ev = pair
        label = "negative lease" if lease < 0 else label  # rejected at decoding, whatever the event
        # The worker id is filled in later (one fresh id per record: see _assign_worker).
        return label, CODEC.encode(EVENT_BATCH, {"worker_id": 0, "epoch": epoch, "lease_ms": lease, "events": [ev]})

    cases = st.one_of(*[s.map(lambda e, label=label: (label, e)) for label, s in IMPOSSIBLE])
    leases = st.integers(1, 10**9) | st.integers(-(1 << 63), -1)  # negative: impossible too
    return st.builds(encode, cases, leases, I64)


def huge_records(n: int) -> list[tuple[str, bytes]]:
    """Stores of 5,000-50,000 blocks (up to 800 kB, near the broker's 1 MB message limit) whose
    parent no worker holds: a burst of work that must be rejected whole."""
    out = []
    for i in range(n):
        k = 5_000 + i * (45_000 // max(1, n - 1))
        ev = _event(parent_hash=7, block_hashes=struct.pack(f"<{k}Q", *range(100, 100 + k)),
                    tokens_hashes=struct.pack(f"<{k}Q", *range(k)))
        out.append(("huge block list", CODEC.encode(EVENT_BATCH, {"worker_id": 0, "epoch": 1, "lease_ms": 1000, "events": [ev]})))
    return out


def _epoch_ahead(value: bytes, record_ms: int) -> bool:
    """Whether a replica with the default settings rejects this batch's epoch (records
    are stamped within seconds of ``record_ms``)."""
    batch = EventCodec(CODEC).decode(value)
    bound = FoldSettings().max_epoch_ahead_ms
    return batch.epoch // 1_000_000 > record_ms + bound


def _valid_batch() -> bytes:
    w = FakeWorkerLog(FIRST_FUZZ_WORKER - 1)
    return w.batch(w.cleared(), w.stored(list(range(48))))


VALID = _valid_batch()
KNOWN = {bytes(CODEC.fingerprint(n)) for n in ("kvstream.events.EventBatch", "kvstream.control.ResyncRequest", "kvstream.active.ActiveOp")}

RECORD = st.one_of(
    st.binary(max_size=200).map(lambda b: ("random bytes", b)),
    st.integers(0, len(VALID) - 1).map(lambda n: ("truncated Avro", VALID[:n])),
    st.binary(min_size=8, max_size=8).filter(lambda f: f not in KNOWN).map(lambda f: ("wrong fingerprint", MARKER + f + VALID[10:])),
    _impossible(),
)


def _assign_worker(value: bytes, wid: int) -> bytes:
    """Give a valid-Avro record its own worker (so no two fuzz records meet in the fold:
    each is judged alone, never as a duplicate of another)."""
    try:
        name, rec = CODEC.decode(value)
    except Exception:  # noqa: BLE001 - undecodable on purpose: nothing to re-address
        return value
    rec["worker_id"] = wid - (1 << 64) if wid >= 1 << 63 else wid
    return CODEC.encode(name, rec)


def generate_records() -> list[tuple[str, bytes]]:
    out: list[tuple[str, bytes]] = []

    @settings(max_examples=EXAMPLES, database=None, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(st.lists(RECORD, min_size=RECORDS_PER_EXAMPLE, max_size=RECORDS_PER_EXAMPLE))
    def collect(batch: list[tuple[str, bytes]]) -> None:
        out.extend(batch)

    collect()
    out += huge_records(8)
    return [(label, _assign_worker(v, FIRST_FUZZ_WORKER + i)) for i, (label, v) in enumerate(out)]


# -- HTTP ------------------------------------------------------------------------------

_BAD_TOKENS = st.one_of(
    st.integers(max_value=-1), st.integers(min_value=1 << 32), st.text(alphabet="abc xyz", min_size=1),
    st.just(1.5), st.none(), st.lists(st.integers(), max_size=2),
)
BAD_ROUTE = st.one_of(
    st.binary(max_size=64).filter(lambda b: not b.strip().startswith((b"{", b"["))).map(lambda b: ("raw", b)),
    st.lists(_BAD_TOKENS, min_size=1, max_size=5).map(lambda t: ("json", {"token_ids": [1, *t]})),
    st.text(min_size=1, max_size=10)
    .filter(lambda k: k not in RouteRequest.__struct_fields__)
    .map(lambda k: ("json", {"token_ids": [1], k: 1})),
    st.sampled_from(["", "x" * 257]).map(lambda r: ("json", {"token_ids": [1], "request_id": r})),
    st.floats(max_value=-0.001, allow_nan=False, allow_infinity=False).map(lambda v: ("json", {"token_ids": [1], "weights": {"router_temperature": v}})),
    st.integers(max_value=-1).map(lambda w: ("json", {"token_ids": [1], "weights": {"allowed_workers": [w]}})),
    st.one_of(st.integers(), st.text(), st.lists(st.integers(), max_size=3), st.just({})).map(lambda b: ("json", b)),
    st.just(("json", {"token_ids": [1], "query_only": [True]})),
)


def _bad_requests(n: int) -> list[tuple[str, object]]:
    out: list[tuple[str, object]] = []

    @settings(max_examples=n, database=None, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(BAD_ROUTE)
    def collect(req) -> None:
        out.append(req)

    collect()
    return out


@pytest.mark.timeout(600)
def test_fuzzed_records_and_requests(kafka_topics_factory) -> None:
    started = time.monotonic()
    s: Settings = kafka_topics_factory(events_partitions=4)
    real = FakeWorkerLog(REAL)
    tokens = list(range(16 * 6))
    good = [
        real.batch(real.cleared(), real.stored(tokens)),
        real.batch(real.stored(tokens + list(range(500, 532)), start_block=6)),
    ]
    records = generate_records()
    # Duplicates: the real worker's own events again (at-least-once delivery): counted
    # and skipped, never applied twice; not copied to the DLQ (they are not errors).
    duplicates = [(w := FakeWorkerLog(REAL)).batch(w.cleared(), w.stored(tokens)) for _ in range(200)]
    gen_s = time.monotonic() - started

    register_synthetic(s, [REAL])  # the fuzzed workers never register
    r = start(s)
    try:
        p = Producer(producer_config(s, **{"message.max.bytes": 1_000_000}))
        topic = s.topics.name("events")
        for v in good:
            p.produce(topic, v, key=REAL.to_bytes(8, "big"))
        assert p.flush(30) == 0
        wait_caught_up(r, s)
        with r.lock:
            before = comparable(r.fold)[0]
        assert set(before) == {REAL}
        produced_ms = int(time.time() * 1000)
        for i, (_, v) in enumerate(records):
            p.produce(topic, v, key=(FIRST_FUZZ_WORKER + i).to_bytes(8, "big"))
            if i % 1000 == 0:
                p.poll(0)
        for v in duplicates:
            p.produce(topic, v, key=REAL.to_bytes(8, "big"))
        assert p.flush(60) == 0
        with TestClient(create_app(r)) as client:
            statuses = Counter()
            requests = _bad_requests(REQUESTS)
            for kind, body in requests:
                if kind == "raw":
                    resp = client.post("/v1/route", content=body, headers={"content-type": "application/json"})
                else:
                    resp = client.post("/v1/route", json=body)
                statuses[resp.status_code] += 1
                assert 400 <= resp.status_code < 500, (body, resp.status_code, resp.text)
            for rid, status in (("nope", 404), ("x" * 300, 422), ("%00", 422)):  # 422: not a safe id
                assert client.post(f"/v1/requests/{rid}/prefill_done").status_code == status
                assert client.delete(f"/v1/requests/{rid}").status_code == status
                statuses[status] += 2
            assert client.get("/v1/route").status_code == 405
            wait_caught_up(r, s, timeout=240)
            assert r.wait_ready(30)
            # Still serving, and routing finds the real worker's blocks.
            ok = client.post("/v1/route", json={"token_ids": tokens, "query_only": True})
            assert ok.status_code == 200, ok.text
            assert client.get("/healthz").status_code == 200
            assert client.get("/readyz").status_code == 200
        with r.lock:
            after = comparable(r.fold)
            counters = Counter(r.fold.counters) + Counter(r.router.rejections())
            dlq_count = r.metrics.dlq._value.get()
            http_errors = {c: r.metrics.http_errors.labels(status=str(c))._value.get() for c in statuses}
        assert http_errors == dict(statuses), "every 4xx is counted"
        agrees_with_log(r, s)
        assert after[0] == before, "rejected input changed the index"
        assert counters[DUPLICATE] == 2 * len(duplicates)
        undecodable = sum(1 for label, _ in records if label in ("random bytes", "truncated Avro", "wrong fingerprint"))
        assert counters[DECODE_ERROR] >= undecodable
        # A remove of unknown blocks is skipped, not an error, unless its (random) epoch
        # is implausible: far ahead of its record's time (kvstream.replica.authority).
        bad = [v for label, v in records if label != SKIPPED or _epoch_ahead(v, produced_ms)]
        assert counters[UNKNOWN_REMOVE] == 2 * (len(records) - len(bad))
        dlq = read_all(s, "dlq", timeout=120, want=len(bad))
        assert dlq_count == len(bad) == len(dlq)
        # Records over the DLQ's size bound (the huge stores) are referenced by digest.
        referenced = [json.loads(m.value()) for m in dlq if "kvstream-dlq-reference" in dict(m.headers())]
        assert len(referenced) == sum(1 for v in bad if len(v) > ReplicaOptions().dlq_max_bytes) > 0
        copied = sorted(hashlib.sha256(m.value() or b"").hexdigest() for m in dlq if "kvstream-dlq-reference" not in dict(m.headers()))
        assert sorted(copied + [ref["sha256"] for ref in referenced]) == sorted(hashlib.sha256(v).hexdigest() for v in bad)
        errors = [dict(m.headers())["kvstream-error"].decode() for m in dlq]
        # "record_undecodable: <why>" or "event <i> (id <n>): <index counter reason>"
        reasons = Counter(e.split(": ")[1] if e.startswith("event ") else e.split(":")[0] for e in errors)
        assert all(errors) and sum(reasons.values()) == len(bad)
    finally:
        r.stop()
    labels = Counter(label for label, _ in records)
    print(f"FAULTS fuzz records={len(records)} duplicates={len(duplicates)} requests={len(requests) + 7} "
          f"statuses={dict(statuses)} gen_s={gen_s:.1f} total_s={time.monotonic() - started:.1f}")
    print(f"FAULTS fuzz labels={dict(labels)}")
    print(f"FAULTS fuzz reasons={dict(reasons)}")
    print(f"FAULTS fuzz counters={dict(+counters)}")


def test_rejected_events_do_not_make_a_worker_routable() -> None:
    """What the fuzzer found: a record from an unseen worker whose events were all
    rejected (or removes of blocks it never had) registered that worker in the index,
    with no blocks, as a routing candidate."""
    fold = new_fold()
    w = FakeWorkerLog(9)
    tokens = list(range(64))
    orphan = w.stored(tokens, start_block=2)  # its parent was never stored
    for offset, value in enumerate([w.batch(orphan), w.batch(w.removed(tokens)), w.batch(orphan, w.removed(tokens))]):
        fold.apply_record(0, offset, offset, value)
        assert not fold.router.knows(9) and fold.router.workers() == []
    fold.apply_record(0, 3, 3, w.batch(w.stored(tokens)))
    assert fold.router.knows(9)
