"""The fold's one path (every record read into the packed form, then one decision per
event; kvstream.replica.fold) decides what the model objects imply: a fold of a random
log must give, record by record, the outcome of the reference fold
(tests/replica/reference_fold.py: the generic decoding into model objects, the Python
digest, the index's apply of model events) and end in the same state (workers, ids,
digests, counters, index).

Each record is written as v1 (what the compiled reader takes as it is), as the test-only
v2 (tests/events/data/schemas) or as v1 with its events in a sized array block (valid
Avro the compiled reader leaves to the generic path): the last two are decoded the
generic way and brought to the packed form by the compiled writer, and must fold as
their v1 equivalents do. The log mixes what a fleet sends with what goes wrong: gaps,
duplicates, reused ids, new and stale epochs, moves between partitions, wrong keys,
parents not held, removes of unknown blocks, events past the authority's limits, leases
running out.
"""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstream.events.codec import EVENT_BATCH, AvroCodec, EventCodec
from kvstream.events.model import Cleared, EventBatch, Removed, RouterEvent, Stored, Tier
from kvstream.events.schemas import DEFAULT_SCHEMA_DIR, SchemaStore
from kvstream.events.wire import worker_key
from kvstream.replica.authority import LogAuthority
from kvstream.replica.fold import LogFold
from kvstream.router import Router

from tests.events.test_codec import zigzag

from .helpers import CODEC
from .reference_fold import ModelFold

AUTHORITY = LogAuthority(
    check_key=True, max_epoch_ahead_ms=1_000, max_lease_ms=5_000, max_blocks_per_event=5,
    max_blocks_per_worker=9, max_workers_per_partition=2, max_blocks_per_partition=14,
)
WORKERS = (3, 4, 5)
HASHES = tuple(range(1, 13))
V2_DIR = Path(__file__).parents[1] / "events" / "data" / "schemas"
WAYS = ("v1", "v2", "sized")


@pytest.fixture(scope="module")
def codecs(tmp_path_factory: pytest.TempPathFactory) -> tuple[EventCodec, EventCodec]:
    """(a replica's codec that also knows v2 (v1 current: the compiled reader's), one
    whose current schema is v2 (every record goes the generic way))."""
    root = tmp_path_factory.mktemp("schemas")
    shutil.copytree(DEFAULT_SCHEMA_DIR, root, dirs_exist_ok=True)
    shutil.copytree(V2_DIR, root, dirs_exist_ok=True)
    return EventCodec(AvroCodec(SchemaStore(root, pins={EVENT_BATCH: 1}))), EventCodec(AvroCodec(SchemaStore(root)))


def sized(batch: EventBatch) -> bytes:
    """``batch`` in v1 with its events in one sized (negative-count) array block."""
    data = CODEC.encode(batch)
    if not batch.events:
        return data
    head = CODEC.encode(EventBatch(batch.worker_id, batch.epoch, batch.lease_ms, ()))[:-1]
    n = len(batch.events)
    items = data[len(head) + len(zigzag(n)) : -1]
    return head + zigzag(-n) + zigzag(len(items)) + items + zigzag(0)


def encode(way: str, batch: EventBatch, v2: EventCodec) -> bytes:
    if way == "v2":
        return v2.encode(batch)
    return sized(batch) if way == "sized" else CODEC.encode(batch)


Log = list[tuple[int, int, bytes | None, EventBatch | None, str]]


@st.composite
def logs(draw: st.DrawFn) -> Log:
    """(partition, timestamp, key, batch or None for a tick, how it is written) records."""
    next_ids: dict[tuple[int, int, int], int] = {}
    out: Log = []
    ts = 0
    for _ in range(draw(st.integers(1, 40))):
        ts += draw(st.sampled_from([0, 1, 50, 2_000]))
        wid = draw(st.sampled_from(WORKERS))
        partition = draw(st.sampled_from([wid % 2] * 6 + [1 - wid % 2]))
        if draw(st.integers(0, 15)) == 0:
            out.append((partition, ts, None, None, "v1"))
            continue
        epoch = draw(st.sampled_from([2] * 6 + [1, 3]))
        events: list[RouterEvent] = []
        for _ in range(draw(st.integers(0, 3))):
            rank = draw(st.sampled_from([0, 0, 1]))
            tier = draw(st.sampled_from([Tier.DEVICE, Tier.DEVICE, Tier.HOST_PINNED]))
            nid = next_ids.get((wid, epoch, rank), 1)
            eid = nid + draw(st.sampled_from([0] * 8 + [-1, 1, -3]))
            eid = max(0, eid)
            next_ids[(wid, epoch, rank)] = max(nid, eid + 1)
            kind = draw(st.sampled_from(["stored"] * 4 + ["removed", "cleared"]))
            if kind == "cleared":
                events.append(Cleared(wid, rank, tier, epoch, eid))
                continue
            blocks = tuple(draw(st.lists(st.sampled_from(HASHES), min_size=1, max_size=7, unique=True)))
            if kind == "removed":
                events.append(Removed(wid, rank, tier, epoch, eid, blocks))
                continue
            parent = draw(st.none() | st.sampled_from(HASHES))
            tokens = tuple(draw(st.integers(0, 3)) for _ in blocks)
            events.append(Stored(wid, rank, tier, epoch, eid, parent, blocks, tokens))
        key = worker_key(wid) if draw(st.integers(0, 20)) else worker_key(wid + 1)
        lease = draw(st.sampled_from([1_000] * 5 + [10_000]))
        out.append((partition, ts, key, EventBatch(wid, epoch, lease, tuple(events)), draw(st.sampled_from(WAYS))))
    return out


def state(fold: LogFold) -> Any:
    index = fold.router
    workers = {
        w: (log.partition, log.epoch, log.lease_ms, log.last_seen_ms, dict(log.last_ids),
            {r: dict(seen) for r, seen in log.recent.items()}, log.stored)
        for w, log in fold.workers.items()
    }
    blocks = {
        (k, t): dict(index.blocks(k, t)) for k in index.workers() for t in (Tier.DEVICE, Tier.HOST_PINNED)
    }
    return workers, +fold.counters, +Counter(index.rejections()), index.tree_sizes(), blocks, fold.dirty, fold.next_offsets()


@given(logs())
@settings(max_examples=300, deadline=None)
def test_the_fold_decides_what_the_model_objects_imply(codecs: tuple[EventCodec, EventCodec], log: Log) -> None:
    replica_codec, v2_codec = codecs
    reference = ModelFold(Router(), replica_codec, AUTHORITY)
    fold = LogFold(Router(), replica_codec, AUTHORITY)  # v1 records as they are, others rewritten
    generic = LogFold(Router(), v2_codec, AUTHORITY)  # every record rewritten
    offsets: dict[int, int] = {}
    for partition, ts, key, batch, way in log:
        offset = offsets[partition] = offsets.get(partition, -1) + 1
        value = None if batch is None else encode(way, batch, v2_codec)
        want = reference.apply_record(partition, offset, ts, value, batch is None, key)
        assert fold.apply_record(partition, offset, ts, value, batch is None, key) == want
        assert generic.apply_record(partition, offset, ts, value, batch is None, key) == want
    assert state(fold) == state(reference) == state(generic)


def test_records_of_every_writing_fold_as_their_v1() -> None:
    """Not a vacuous equality: a fleet's steady records, a gap and a reused id, written
    each way, give the same outcomes (decided, not refused for their layout)."""
    root = Path(__file__).parents[1] / "events" / "data" / "schemas"
    v2 = EventCodec(AvroCodec(SchemaStore(root)))
    batches = [
        EventBatch(3, 2, 1_000, (Cleared(3, 0, Tier.DEVICE, 2, 1),)),
        EventBatch(3, 2, 1_000, (Stored(3, 0, Tier.DEVICE, 2, 2, None, (1, 2), (5, 6)),)),
        EventBatch(3, 2, 1_000, (Stored(3, 0, Tier.DEVICE, 2, 3, 2, (3,), (7,)), Removed(3, 0, Tier.DEVICE, 2, 4, (1,)))),
        EventBatch(3, 2, 1_000, ()),
        EventBatch(3, 2, 1_000, (Stored(3, 0, Tier.DEVICE, 2, 9, None, (4,), (8,)),)),  # a gap
        EventBatch(3, 2, 1_000, (Stored(3, 0, Tier.DEVICE, 2, 9, None, (5,), (9,)),)),  # id 9 reused
    ]
    held = []
    for way in WAYS:
        fold = LogFold(Router(), v2 if way == "v2" else CODEC, AUTHORITY)
        values = [encode(way, b, v2) for b in batches]
        if way != "v1":
            assert values[1] != CODEC.encode(batches[1])
        outs = [fold.apply_record(1, k, k, v, False, worker_key(3)) for k, v in enumerate(values)]
        assert [o.applied_events for o in outs] == [1, 1, 2, 0, 1, 0], way
        assert [o.resync for o in outs] == [(), (), (), (), (3,), (3,)], way
        assert outs[-1].dlq_reason == "event 0 (id 9): event_id_conflict", way
        held.append(dict(fold.router.blocks((3, 0), Tier.DEVICE)))
    assert set(held[0]) == {2, 3, 4}  # block 1 removed, block 5 refused
    assert held[1] == held[0] and held[2] == held[0]


def test_the_partition_budget_counts_exactly_before_it_refuses() -> None:
    """The fold keeps an upper bound of the partition's blocks (removes not taken off):
    a store the bound would refuse is decided on the exact count, as the reference
    counts every time."""
    authority = LogAuthority(max_blocks_per_partition=14)
    records = [CODEC.encode(EventBatch(3, 2, 1_000, (ev,))) for ev in (
        Cleared(3, 0, Tier.DEVICE, 2, 1),
        Stored(3, 0, Tier.DEVICE, 2, 2, None, (1, 2, 3, 4, 5), (1, 2, 3, 4, 5)),
        Stored(3, 0, Tier.DEVICE, 2, 3, 5, (6, 7, 8, 9, 10), (6, 7, 8, 9, 10)),
        Removed(3, 0, Tier.DEVICE, 2, 4, (6, 7, 8, 9, 10)),
        Stored(3, 0, Tier.DEVICE, 2, 5, 5, (11, 12, 13, 14, 15), (11, 12, 13, 14, 15)),  # 10 held after
        Stored(3, 0, Tier.DEVICE, 2, 6, 15, (16, 17, 18, 19, 20), (16, 17, 18, 19, 20)),  # 15 > 14
    )]
    fold, reference = LogFold(Router(), CODEC, authority), ModelFold(Router(), CODEC, authority)
    outs = [fold.apply_record(0, k, k, v) for k, v in enumerate(records)]
    assert outs == [reference.apply_record(0, k, k, v) for k, v in enumerate(records)]
    assert [o.applied_events for o in outs] == [1, 1, 1, 1, 1, 0]
    assert outs[-1].dlq_reason is not None and "partition_block_limit" in outs[-1].dlq_reason
    assert state(fold) == state(reference)
