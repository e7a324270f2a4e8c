"""The fold's compiled path (packed records, kvstream.replica.fold.LogFold._apply_packed)
decides exactly as its general path: two folds of the same random log — one given an
EventCodec's own ``decode`` (which enables the compiled path), one a plain function
(general path only) — must give the same outcome for every record and end in the same
state (workers, ids, digests, counters, index).

The log mixes what a fleet sends with what goes wrong: gaps, duplicates, reused ids,
new and stale epochs, moves between partitions, wrong keys, parents not held, removes
of unknown blocks, events past the authority's limits, leases running out.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from kvstream.events.model import Cleared, EventBatch, Removed, RouterEvent, Stored, Tier
from kvstream.events.wire import worker_key
from kvstream.replica.authority import LogAuthority
from kvstream.replica.fold import LogFold
from kvstream.router import Router

from .helpers import CODEC

AUTHORITY = LogAuthority(
    check_key=True, max_epoch_ahead_ms=1_000, max_lease_ms=5_000, max_blocks_per_event=5,
    max_blocks_per_worker=9, max_workers_per_partition=2, max_blocks_per_partition=14,
)
WORKERS = (3, 4, 5)
HASHES = tuple(range(1, 13))


@st.composite
def logs(draw: st.DrawFn) -> list[tuple[int, int, bytes | None, bytes | None, bool]]:
    """(partition, timestamp, key, value, is_tick) records."""
    next_ids: dict[tuple[int, int, int], int] = {}
    out = []
    ts = 0
    for _ in range(draw(st.integers(1, 40))):
        ts += draw(st.sampled_from([0, 1, 50, 2_000]))
        wid = draw(st.sampled_from(WORKERS))
        partition = draw(st.sampled_from([wid % 2] * 6 + [1 - wid % 2]))
        if draw(st.integers(0, 15)) == 0:
            out.append((partition, ts, None, None, True))
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
        out.append((partition, ts, key, CODEC.encode(EventBatch(wid, epoch, lease, tuple(events))), False))
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
def test_compiled_and_general_paths_fold_alike(log: list[tuple[int, int, bytes | None, bytes | None, bool]]) -> None:
    compiled = LogFold(Router(), CODEC.decode, AUTHORITY)
    general = LogFold(Router(), lambda value: CODEC.decode(value), AUTHORITY)
    assert compiled._read_packed is not None and general._read_packed is None
    offsets: dict[int, int] = {}
    for partition, ts, key, value, tick in log:
        offset = offsets[partition] = offsets.get(partition, -1) + 1
        a = compiled.apply_record(partition, offset, ts, value, tick, key)
        b = general.apply_record(partition, offset, ts, value, tick, key)
        assert a == b
    assert state(compiled) == state(general)


def test_the_common_record_takes_the_compiled_path() -> None:
    """Not a vacuous equality: a fleet's steady records do take the compiled path."""
    fold = LogFold(Router(), CODEC.decode, AUTHORITY)
    taken = []
    apply_packed = fold._apply_packed

    def spy(*args: Any) -> Any:
        out = apply_packed(*args)
        taken.append(out is not None)
        return out

    fold._apply_packed = spy  # type: ignore[method-assign]
    batches = [
        EventBatch(3, 2, 1_000, (Cleared(3, 0, Tier.DEVICE, 2, 1),)),
        EventBatch(3, 2, 1_000, (Stored(3, 0, Tier.DEVICE, 2, 2, None, (1, 2), (5, 6)),)),
        EventBatch(3, 2, 1_000, (Stored(3, 0, Tier.DEVICE, 2, 3, 2, (3,), (7,)), Removed(3, 0, Tier.DEVICE, 2, 4, (1,)))),
        EventBatch(3, 2, 1_000, ()),
        EventBatch(3, 2, 1_000, (Stored(3, 0, Tier.DEVICE, 2, 9, None, (4,), (8,)),)),  # a gap
    ]
    outs = [fold.apply_record(1, k, k, CODEC.encode(b), False, worker_key(3)) for k, b in enumerate(batches)]
    assert taken == [False, True, True, True, False]
    assert [o.applied_events for o in outs] == [1, 1, 2, 0, 1]
    assert outs[-1].resync == (3,)
