"""Issue 9 (1): ``kill -9`` a ``kvstream router`` process at random points of ingest and of
its snapshot writes, 20 times; after each crash the replica restarted from what the dead
process left on disk equals a reference fold of the same log: no event applied twice
(no duplicate, gap or stale-epoch count while replaying the tail), none skipped."""

from __future__ import annotations

import random
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest
from confluent_kafka import Producer

from kvstream.events.codec import AvroCodec
from kvstream.kafka.config import producer_config
from kvstream.replica.fold import DUPLICATE, GAP, NO_CLEARED, STALE_EPOCH
from kvstream.replica.replica import Replica, ReplicaOptions
from kvstream.replica.snapshot import SnapshotStore
from kvstream.tools.procs import free_port

from tests.faults.helpers import (
    agrees_with_log,
    spawn_router,
    stop_process,
    wait_http,
)
from tests.replica.test_replica_kafka import wait_caught_up
from tests.replica.test_snapshot import random_log

pytestmark = [pytest.mark.faults, pytest.mark.kafka, pytest.mark.slow]

KILLS = 20


def clean_log(seed: int) -> list[tuple[int, bytes]]:
    """(worker id, record) of one random, well-formed log (the snapshot tests' shape:
    stores, removes, clears, two ranks, four tiers, over shared prefixes), each worker's
    records in order."""
    logs, _ = random_log(seed, workers=8, batches=40)
    codec = AvroCodec()
    return [(codec.decode(v)[1]["worker_id"], v) for recs in logs.values() for _, v in recs]


def _produce_slowly(settings, records) -> None:
    """Publish all of ``records``, one every 50 ms, so that the kill lands mid-ingest."""
    p = Producer(producer_config(settings))
    topic = settings.topics.name("events")
    for wid, value in records:
        p.produce(topic, value=value, key=wid.to_bytes(8, "big"))
        p.poll(0)
        time.sleep(0.05)
    assert p.flush(30) == 0


@pytest.mark.timeout(420)
def test_kill_9_during_ingest_and_snapshots(kafka_topics_factory, tmp_path: Path) -> None:
    settings = kafka_topics_factory(events_partitions=3)
    records = clean_log(11)
    step = -(-len(records) // KILLS)
    chunks = [records[i : i + step] for i in range(0, len(records), step)]
    assert len(chunks) == KILLS
    snap = tmp_path / "snap"
    rng = random.Random(9)
    generations: list[int] = []
    started = time.monotonic()
    for i, chunk in enumerate(chunks):
        port = free_port()
        # A snapshot after every record: the writer is nearly always mid-generation.
        proc = spawn_router(
            settings, port, tmp_path / "router.log",
            snapshot_dir=snap, snapshot_every_records=1, snapshot_every_s=0,
        )
        producer = threading.Thread(target=_produce_slowly, args=(settings, chunk))
        try:
            # Serving means recovery is done and the ingest thread runs; the kill then
            # lands at a random point of the tail's ingest and its snapshot generations.
            wait_http(f"http://127.0.0.1:{port}/healthz", 60, proc)
            producer.start()
            time.sleep(rng.uniform(0.05, 1.5))
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
        finally:
            stop_process(proc)
            if producer.ident is not None:
                producer.join(60)
        # Verify a copy, so the next process restarts from exactly what this one left.
        probe = tmp_path / f"probe-{i}"
        shutil.copytree(snap, probe) if snap.exists() else probe.mkdir()
        store = SnapshotStore(probe)
        head = store.head()
        store.close()
        generations.append(head[0] if head else 0)
        r = Replica(settings, ReplicaOptions(snapshot_dir=probe, tick_interval_s=3600.0))
        r.start()
        try:
            assert r.wait_ready(60), f"kill {i}: restarted replica never became ready"
            wait_caught_up(r, settings)
            truth = agrees_with_log(r, settings)
            with r.lock:
                replayed = {k: r.fold.counters[k] for k in (DUPLICATE, GAP, NO_CLEARED, STALE_EPOCH)}
            # The log is clean (the reference counts none): any count is a re-applied
            # or skipped event after the restart.
            assert {k: truth.counters[k] for k in replayed} == dict.fromkeys(replayed, 0)
            assert replayed == dict.fromkeys(replayed, 0), f"kill {i}: tail replay saw {replayed}"
        finally:
            r.stop()
            shutil.rmtree(probe, ignore_errors=True)
    # The killed processes did commit generations between kills (so restarts really
    # started from their snapshots), and others died with one in progress.
    advanced = sum(1 for a, b in zip([0, *generations], generations) if b > a)
    assert advanced >= 3 and generations[-1] > 0, generations
    print(f"FAULTS replica_crash kills={KILLS} records={len(records)} generations_advanced={advanced} "
          f"generations={generations} duration_s={time.monotonic() - started:.1f}")
