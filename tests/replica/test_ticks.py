"""Log-clock ticks (kvstream.replica.ticks): which partitions get one, what a tick
record looks like, and that the fold treats new and old ticks alike."""

from __future__ import annotations

import pytest

from kvstream.events.errors import DecodeError
from kvstream.hashing import local_hashes
from kvstream.replica import fold as F
from kvstream.replica.record import read_headers
from kvstream.replica.ticks import TICK_HEADERS, TICK_KEY, Tick, TickCodec, Ticker, due_partitions

from tests.replica.helpers import FakeWorkerLog, new_fold

TOKENS = list(range(16 * 4))
CODEC = TickCodec()


def two_workers() -> F.LogFold:
    """Worker 1 on partition 0 (lease 1 s), worker 2 on partition 1 (lease 5 s), both
    last seen at 10 s; partition 2 holds nobody."""
    fold = new_fold()
    a, b = FakeWorkerLog(1, lease_ms=1000), FakeWorkerLog(2, lease_ms=5000)
    fold.apply_record(0, 0, 10_000, a.batch(a.cleared(), a.stored(TOKENS)))
    fold.apply_record(1, 0, 10_000, b.batch(b.cleared(), b.stored(TOKENS)))
    fold.apply_record(2, 0, 10_000, None, is_tick=True)
    return fold


def test_only_partitions_with_a_passed_deadline_are_due() -> None:
    fold = two_workers()
    assert due_partitions(fold, 10_500) == {}  # within every lease
    assert due_partitions(fold, 11_001) == {0: 11_000}  # a's lease ran out; b's did not
    assert due_partitions(fold, 15_001) == {0: 11_000, 1: 15_000}
    # Log time on partition 0 already passed the deadline: the fold expires a on the
    # next record there without our help.
    fold.partitions[0].log_time_ms = 11_500
    assert due_partitions(fold, 15_001) == {1: 15_000}


def test_a_busy_partition_needs_no_tick() -> None:
    fold = two_workers()
    b = FakeWorkerLog(2, lease_ms=5000)
    b.next_id[0] = 2
    for i, ts in enumerate(range(12_000, 40_000, 2000)):  # heartbeats renew the lease
        fold.apply_record(1, 1 + i, ts, b.batch())
        assert 1 not in due_partitions(fold, ts + 1000)


def test_ticker_writes_keyed_schemad_ticks_at_most_every_interval() -> None:
    fold = two_workers()
    written: list[tuple[int, bytes, bytes, list]] = []
    now = [11_001 / 1000]
    ticker = Ticker("r1", 3600.0, lambda *rec: written.append(rec), CODEC, clock=lambda: now[0])
    assert ticker.step(fold) == 1
    ((partition, key, value, headers),) = written
    assert partition == 0 and key == TICK_KEY and headers == TICK_HEADERS and read_headers(headers)[0]
    assert int.from_bytes(key, "big", signed=True) == -1  # what a LongDeserializer prints
    assert CODEC.decode(value) == Tick("r1", 11_000)
    now[0] = 20.0
    assert ticker.step(fold) == 0  # not before the interval is over
    assert ticker.written == 1


def test_tick_values() -> None:
    assert CODEC.decode(None) is None  # an old tick
    assert CODEC.decode(CODEC.encode(Tick("replica-x", 2**63 - 1))) == Tick("replica-x", 2**63 - 1)
    with pytest.raises(DecodeError, match="expected a kvstream.events.Tick"):
        CODEC.decode(FakeWorkerLog(1).batch())
    assert not any(read_headers(h)[0] for h in (None, [], [("other", b"")]))


def test_old_and_new_ticks_fold_alike() -> None:
    """The log may hold old ticks (null key and value) and new ones: both only move log
    time, and expire the same worker at the same record."""
    outcomes = []
    for value in (None, CODEC.encode(Tick("r", 11_000))):
        fold = two_workers()
        out = fold.apply_record(0, 1, 11_001, value, is_tick=True)
        assert out == F.Outcome() and fold.next_offsets()[0] == 2
        outcomes.append((sorted(fold.workers), fold.counters[F.EXPIRED],
                         fold.router.find_matches_by_tier(local_hashes(TOKENS))))
    assert outcomes[0] == outcomes[1]
    assert outcomes[0][0] == [2] and outcomes[0][1] == 1
