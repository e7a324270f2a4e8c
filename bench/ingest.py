"""``kvstream bench ingest``: records per second a replica folds, for small batches as a
busy fleet sends them (DESIGN.md §11; issue 27).

The log: ``--workers`` workers, each opening its epoch with ``cleared`` (event id 1),
then round-robin one batch each of one stored event of ``B`` fresh blocks (a root
chain; ids from 2), for ``B`` in ``--blocks``. Real Avro ``EventBatch`` records, encoded
beforehand by the project's codec, keyed by worker as the publisher keys them.

Per ``B``, in the same run:

- **baseline**: the pure index apply (``Router.apply_event``) of the same stored events,
  decoded beforehand, into a fresh router: the floor any fold of these records pays;
- **fold**: :class:`~kvstream.replica.fold.LogFold` (the replica's authority) applying
  the records as :func:`~kvstream.replica.record.read_record` gives them (read
  beforehand), one ``apply`` each;
- **replica** (unless ``--no-kafka``): the records produced to a fresh events topic,
  then a :class:`~kvstream.replica.replica.Replica` started on it; the clock runs from
  the moment its fold has applied its first record to the moment it has read every
  partition to the end (consume, read, fold, locks: the replica's real ingest path).

Rates are records (batches) per second and block events per second (wall clock), with
the CPU time per record beside them (``*_cpu_*``: what this process spent, which other
processes' turns on a shared machine do not inflate); ratios are to the baseline of the
same ``B``, in-process figures the best of three rounds. Compare ratios: other processes
share this machine.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Sequence
from typing import Any

import click
import numpy as np

from kvstream.events.codec import EventCodec
from kvstream.events.model import Cleared, EventBatch, Stored, Tier
from kvstream.events.wire import worker_key
from kvstream.replica.authority import authority_from_settings
from kvstream.replica.fold import LogFold
from kvstream.replica.record import Record
from kvstream.replica.replica import Replica
from kvstream.router import Router
from kvstream.settings import FoldSettings
from bench.common import emit, json_option
from bench.kafka_env import bench_topics, bootstrap_option, broker, produce_records
from bench.restart import replica_options

EPOCH = 1
LEASE_MS = 24 * 3600 * 1000
PARTITIONS = 4


def fleet_log(n_workers: int, n_records: int, blocks: int, seed: int) -> tuple[list[tuple[int, bytes]], list[Stored]]:
    """``(worker id, value)`` records (each worker's ``cleared`` first, then ``n_records``
    one-event stored batches round-robin) and the stored events they carry."""
    rng = np.random.default_rng(seed)
    codec = EventCodec()
    workers = [1000 + i for i in range(n_workers)]
    records = [
        (w, codec.encode(EventBatch(w, EPOCH, LEASE_MS, (Cleared(w, 0, Tier.DEVICE, EPOCH, 1),)))) for w in workers
    ]
    hashes = rng.integers(0, 2**64, (n_records, 2, blocks), dtype=np.uint64).tolist()
    stored = []
    for k in range(n_records):
        w = workers[k % n_workers]
        ev = Stored(w, 0, Tier.DEVICE, EPOCH, 2 + k // n_workers, None, tuple(hashes[k][0]), tuple(hashes[k][1]))
        stored.append(ev)
        records.append((w, codec.encode(EventBatch(w, EPOCH, LEASE_MS, (ev,)))))
    return records, stored


#: Rounds of the in-process measurements; the best is kept (noise only ever slows).
ROUNDS = 3


def _timed(fn: Any) -> tuple[float, float]:
    """(wall, CPU) seconds of ``fn()``."""
    gc.collect()
    gc.disable()  # a collection pass in the middle would time the collector
    try:
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        return time.perf_counter() - t0, time.process_time() - c0
    finally:
        gc.enable()


def _best(runs: Sequence[tuple[float, float]]) -> tuple[float, float]:
    return min(r[0] for r in runs), min(r[1] for r in runs)


def baseline_s(events: Sequence[Stored]) -> tuple[float, float]:
    """(wall, CPU) seconds to apply ``events`` straight to a fresh router's index."""

    def once() -> tuple[float, float]:
        apply = Router().apply_event
        return _timed(lambda: [apply(ev) for ev in events])

    return _best([once() for _ in range(ROUNDS)])


def fold_s(records: Sequence[tuple[int, bytes]], n_stored: int) -> tuple[float, float]:
    """(wall, CPU) seconds the fold takes for the stored records (the ``cleared`` ones
    are applied first, untimed)."""
    read = [
        Record(w % PARTITIONS, k, 1_000 + k, worker_key(w), value) for k, (w, value) in enumerate(records)
    ]
    opening, timed = read[: len(read) - n_stored], read[len(read) - n_stored :]

    def once() -> tuple[float, float]:
        fold = LogFold(Router(), EventCodec(), authority_from_settings(FoldSettings()))
        apply = fold.apply
        for r in opening:
            apply(r)
        elapsed = _timed(lambda: [apply(r) for r in timed])
        if +fold.counters:
            raise click.ClickException(f"the fold rejected records of the bench log: {dict(+fold.counters)}")
        return elapsed

    return _best([once() for _ in range(ROUNDS)])


def replica_s(bootstrap: str, records: Sequence[tuple[int, bytes]], timeout: float) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds of this process, records) a replica takes to fold the
    log from a pre-filled topic: from its fold's first applied record until it has read
    every partition to the end. The CPU time counts every thread of the process (the
    Kafka client's included)."""
    with bench_topics(bootstrap, events_partitions=PARTITIONS) as settings:
        produce_records(settings, records, desc="filling the topic")
        total = len(records)
        replica = Replica(settings, replica_options(None))
        replica.start()
        try:
            deadline = time.monotonic() + timeout
            first: tuple[float, float, int] | None = None
            while True:
                with replica.lock:
                    done = sum(replica.fold.next_offsets().values())
                now, cpu = time.perf_counter(), time.process_time()
                if first is None and done:
                    first = (now, cpu, done)
                if done >= total:
                    break
                if time.monotonic() > deadline:
                    raise click.ClickException(f"the replica read {done} of {total} records in {timeout:.0f}s")
                time.sleep(0.002)
            assert first is not None
            if replica.fold.counters["record_undecodable"]:
                raise click.ClickException(f"the replica could not decode records: {dict(+replica.fold.counters)}")
            return now - first[0], cpu - first[1], total - first[2]
        finally:
            replica.stop()


@click.command("ingest")
@click.option("--records", "n_records", default=40_000, show_default=True, help="Stored batches per batch size.")
@click.option("--workers", "n_workers", default=1_000, show_default=True, help="Workers publishing them.")
@click.option("--blocks", default="1,4,16", show_default=True, help="Blocks per batch, comma-separated.")
@click.option("--kafka/--no-kafka", default=True, show_default=True, help="Also fold through a replica from a broker.")
@click.option("--timeout", default=300.0, show_default=True, help="Seconds the replica may take per batch size.")
@click.option("--seed", default=0, show_default=True)
@bootstrap_option
@json_option
def ingest_bench(
    n_records: int, n_workers: int, blocks: str, kafka: bool, timeout: float, seed: int, bootstrap: str | None,
    as_json: bool,
) -> None:
    """Records/s and block events/s the fold and a replica reach on small batches,
    against the pure index apply of the same events."""
    sizes = [int(b) for b in blocks.split(",") if b.strip()]
    if not sizes or min(sizes) < 1 or n_records < 1 or n_workers < 1:
        raise click.BadParameter("--blocks, --records and --workers must be positive")
    logs = {b: fleet_log(n_workers, n_records, b, seed) for b in sizes}
    result: dict[str, Any] = {"records": n_records, "workers": n_workers, "partitions": PARTITIONS}
    for b, (records, stored) in logs.items():
        click.echo(f"folding {n_records} records of {b} block(s)...", err=True)
        base, base_cpu = (n_records / t for t in baseline_s(stored))
        fold, fold_cpu = (n_records / t for t in fold_s(records, n_records))
        result.update({
            f"baseline_records_per_s_{b}": round(base),
            f"baseline_cpu_us_per_record_{b}": round(1e6 / base_cpu, 2),
            f"fold_records_per_s_{b}": round(fold),
            f"fold_block_events_per_s_{b}": round(fold * b),
            f"fold_us_per_record_{b}": round(1e6 / fold, 2),
            f"fold_cpu_us_per_record_{b}": round(1e6 / fold_cpu, 2),
            f"fold_ratio_to_baseline_{b}": round(fold / base, 4),
            f"fold_cpu_ratio_to_baseline_{b}": round(fold_cpu / base_cpu, 4),
        })
    if kafka:
        with broker(bootstrap) as servers:
            for b, (records, _) in logs.items():
                click.echo(f"replica folding {len(records)} records of {b} block(s) from the broker...", err=True)
                seconds, cpu_s, n = replica_s(servers, records, timeout)
                rate = n / seconds
                result.update({
                    f"replica_records_per_s_{b}": round(rate),
                    f"replica_block_events_per_s_{b}": round(rate * b),
                    f"replica_us_per_record_{b}": round(1e6 / rate, 2),
                    f"replica_cpu_us_per_record_{b}": round(1e6 * cpu_s / n, 2),
                    f"replica_ratio_to_baseline_{b}": round(rate / result[f"baseline_records_per_s_{b}"], 4),
                })
    with open("/proc/loadavg") as f:
        result["loadavg_1m"] = float(f.read().split()[0])
    emit(result, as_json)
