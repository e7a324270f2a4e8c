"""A router with no worker left says what became of the last ones (issue 26): an expired
worker is named with the log time its lease ran out, not "none has published"."""

from __future__ import annotations

import pytest

from kvstream.events.codec import EventCodec
from kvstream.events.model import Cleared, EventBatch, Stored, Tier
from kvstream.replica.fold import LogFold
from kvstream.router import Router
from kvstream.router.errors import NoEligibleWorkerError

CODEC = EventCodec()


def test_a_route_after_the_last_worker_expired_names_it_and_when():
    fold = LogFold(Router(), CODEC)
    with pytest.raises(NoEligibleWorkerError, match="none has published an event within its lease"):
        fold.router.find_best_match(list(range(32)))
    events = (Cleared(1, 0, Tier.DEVICE, 7, 1), Stored(1, 0, Tier.DEVICE, 7, 2, None, (5,), (6,)))
    assert fold.apply_record(0, 0, 1_764_600_000_000, CODEC.encode(EventBatch(1, 7, 1_000, events))).dlq_reason is None
    assert fold.router.find_best_match(list(range(32))).worker.worker_id == 1
    fold.apply_record(0, 1, 1_764_600_005_000, None, is_tick=True)
    with pytest.raises(NoEligibleWorkerError) as err:
        fold.router.find_best_match(list(range(32)))
    assert str(err.value) == (
        "no workers known: worker 1 expired at 2025-12-01T14:40:01.000Z (no event for its lease of 1000 ms)"
    )


def batch(epoch: int, *events) -> bytes:
    return CODEC.encode(EventBatch(5, epoch, 10_000, events or ()))


def test_alternating_incarnations_of_one_worker_id_are_a_clash():
    from kvstream.replica.fold import STALE_EPOCH, WORKER_CLASH

    fold = LogFold(Router(), CODEC)
    t = 1_764_600_000_000
    a, b = 100, 200
    fold.apply_record(0, 0, t, batch(a, Cleared(5, 0, Tier.DEVICE, a, 1)))
    # A late batch of a's, stamped before b began: a dead process's last words, no clash.
    fold.apply_record(0, 1, t + 1_000, batch(b, Cleared(5, 0, Tier.DEVICE, b, 1)))
    fold.apply_record(0, 2, t + 900, batch(a))
    assert fold.counters[STALE_EPOCH] == 1 and fold.counters[WORKER_CLASH] == 0 and not fold.clashes
    # a publishes after b began: two live processes.
    out = fold.apply_record(0, 3, t + 2_000, batch(a))
    assert out.resync == (5,)
    assert fold.counters[WORKER_CLASH] == 1
    assert fold.clashes[5].view() == {
        "held_epoch": b, "stale_epoch": a, "last_at": "2025-12-01T14:40:02.000Z", "batches": 1,
    }
    # a answers the resync above b; then b is the stale one: the same clash goes on.
    a2 = 300
    fold.apply_record(0, 4, t + 3_000, batch(a2, Cleared(5, 0, Tier.DEVICE, a2, 1)))
    fold.apply_record(0, 5, t + 4_000, batch(b))
    assert fold.clashes[5].view() == {
        "held_epoch": a2, "stale_epoch": b, "last_at": "2025-12-01T14:40:04.000Z", "batches": 2,
    }
