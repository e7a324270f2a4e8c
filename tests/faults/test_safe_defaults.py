"""Issue 28: what an adversary found against the default settings, each against the real
broker with real replicas (in process, or a ``kvstream router`` process) and the real
publisher (kvstream.worker.publisher) as the honest worker. Each test failed on the main
of the issue for the finding's reason (docs/RELIABILITY.md, "Issue 28")."""

from __future__ import annotations

import pytest

from kvstream.events.model import Cleared, EventBatch, Tier
from kvstream.replica.fold import STALE_EPOCH
from kvstream.settings import Settings

from tests.faults.helpers import agrees_with_log
from tests.faults.test_log_authority import _produce_raw, chain
from tests.faults.test_worker_faults import blocks, epoch_truth, publisher, store, until
from tests.replica.test_replica_kafka import start, wait_caught_up

pytestmark = [pytest.mark.faults, pytest.mark.kafka]

D = Tier.DEVICE
NS_PER_S = 1_000_000_000


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
