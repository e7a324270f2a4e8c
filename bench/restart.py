"""``kvstream bench restart``: time to ready of a replica restarted from its snapshot,
against a new replica that replays the whole log, over the same log in the same run
(DESIGN.md §7, §11).

The log holds the ``kvstream bench index`` workload (``--blocks`` block identities over
``--workers`` workers, some of them on lower tiers) as the publisher writes it: per
worker one epoch opened by ``cleared``, event ids from 1, batches cut at the publisher's
limits.
A first replica reads it to the end and takes a snapshot (``snapshot_write_s``: capture,
pack, write and atomic commit), then stops. Both timed starts run from constructing the
``Replica`` to ``wait_ready`` with ``ready_max_lag=0``: the replica's own first report
that every partition is read to its end. The three folds (the snapshot's taker, the
restored one, the replayed one) are checked to hold the same workers and blocks. A breakdown of the restore (blob
read and verify, index import) is measured separately on the same snapshot.
"""

from __future__ import annotations

import gc
import tempfile
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click

from kvstream.events.codec import EventCodec
from kvstream.events.model import Cleared, EventBatch, Stored, Tier
from kvstream.replica.fold import LogFold
from kvstream.replica.replica import Replica, ReplicaOptions
from kvstream.replica.snapshot import SnapshotStore
from kvstream.replica.snapshotter import restore_fold
from kvstream.router import Router
from kvstream.settings import Settings
from bench.common import emit, json_option
from bench.index import make_workload
from bench.kafka_env import bootstrap_option, kafka_env, produce_records, wait_settled
from kvstream.worker.publisher import PublisherOptions

#: Workers in the log keep their lease for the whole run whatever the log clock says.
LEASE_MS = 24 * 3600 * 1000
EPOCH = 1
#: Batches are cut at the publisher's default limits.
_PUBLISHER = PublisherOptions(worker_id=0)


def worker_log(events: Sequence[Stored], lease_ms: int = LEASE_MS) -> list[tuple[int, bytes]]:
    """``(worker id, encoded EventBatch)`` records that publish ``events`` (whatever their
    epoch and ids) as well-behaved workers would: per worker one epoch that starts with
    ``cleared``, event ids from 1 per rank, batches cut at the publisher's limits."""
    codec = EventCodec()
    by_worker: dict[int, list[Stored]] = defaultdict(list)
    for ev in events:
        by_worker[ev.worker_id].append(ev)
    records: list[tuple[int, bytes]] = []
    for wid, evs in by_worker.items():
        next_id: dict[int, int] = defaultdict(lambda: 1)
        next_id[0] = 2
        batches: list[list[Any]] = [[Cleared(wid, 0, Tier.DEVICE, EPOCH, 1)]]
        blocks = 0
        for ev in evs:
            n = len(ev.block_hashes)
            if blocks + n > _PUBLISHER.max_batch_blocks or len(batches[-1]) >= _PUBLISHER.max_batch_events:
                batches.append([])
                blocks = 0
            eid = next_id[ev.dp_rank]
            next_id[ev.dp_rank] = eid + 1
            batches[-1].append(
                Stored(wid, ev.dp_rank, ev.tier, EPOCH, eid, ev.parent_hash, ev.block_hashes, ev.tokens_hashes)
            )
            blocks += n
        records.extend((wid, codec.encode(EventBatch(wid, EPOCH, lease_ms, tuple(b)))) for b in batches if b)
    return records


def replica_options(snapshot_dir: Path | None) -> ReplicaOptions:
    """A replica that is ready only when fully caught up, takes snapshots only when told,
    and publishes no log-clock ticks (they would add records while we measure)."""
    return ReplicaOptions(
        snapshot_dir=snapshot_dir,
        snapshot_every_records=0,
        snapshot_every_s=0,
        ready_max_lag=0,
        tick_interval_s=1e9,
    )


def fold_digest(replica: Replica) -> tuple[Any, ...]:
    """What two folds of the same log must agree on: per-worker epoch and event ids, and
    the block count of every (worker, rank, tier). (Not the offsets: every replica that
    starts writes a log-clock tick to each partition.)"""
    with replica.lock:
        fold = replica.fold
        sizes = {
            (k.worker_id, k.dp_rank, t.value): n
            for k, tiers in replica.router.tree_sizes().items()
            for t, n in tiers.items()
            if n
        }
        workers = {w: (log.epoch, tuple(sorted(log.last_ids.items()))) for w, log in fold.workers.items()}
        return workers, sizes


def _diff(a: tuple[Any, ...], b: tuple[Any, ...]) -> str:
    """The first difference between two fold digests, for the error message."""
    for name, x, y in zip(("workers", "block counts"), a, b):
        if x != y:
            keys = sorted(set(x) | set(y))
            k = next(k for k in keys if x.get(k) != y.get(k))
            return f"{name} differ ({len(keys)} keys), e.g. at {k}: {x.get(k)} vs {y.get(k)}"
    return "no difference"


def timed_start(settings: Settings, options: ReplicaOptions, timeout: float) -> tuple[Replica, float, float]:
    """A started replica, the seconds from its construction to ready, and the CPU
    seconds this process spent meanwhile (on a shared machine, wall time also counts
    other processes' turns)."""
    t0, cpu0 = time.perf_counter(), time.process_time()
    replica = Replica(settings, options)
    replica.start()
    if not replica.wait_ready(timeout):
        replica.stop()
        raise click.ClickException(f"replica not ready within {timeout:.0f}s (lag {replica.lag()})")
    return replica, time.perf_counter() - t0, time.process_time() - cpu0


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


@click.command("restart")
@bootstrap_option
@click.option("--blocks", "n_blocks", default=1_000_000, show_default=True, help="Block identities in the log.")
@click.option("--workers", "n_workers", default=128, show_default=True)
@click.option("--partitions", default=12, show_default=True, help="Partitions of the events topic.")
@click.option("--event-blocks", default=32, show_default=True, help="Blocks per stored event.")
@click.option("--timeout", default=600.0, show_default=True, help="Longest wait for a replica (s).")
@click.option("--seed", default=0, show_default=True)
@json_option
def restart_bench(
    bootstrap: str | None,
    n_blocks: int,
    n_workers: int,
    partitions: int,
    event_blocks: int,
    timeout: float,
    seed: int,
    as_json: bool,
) -> None:
    """Time to ready from a snapshot vs. from a full replay of the same log."""
    click.echo(f"building a log of {n_blocks:,} blocks over {n_workers} workers...", err=True)
    w = make_workload(n_blocks, n_workers, 32, event_blocks, 512, 0, seed)
    records = worker_log(w.events)
    blocks, tier_blocks = w.blocks, w.tier_blocks
    del w
    log_bytes = sum(len(v) for _, v in records)
    with kafka_env(bootstrap, events_partitions=partitions) as settings:
        produce_records(settings, records, "writing the log")
        n_records = len(records)
        del records
        gc.collect()
        with tempfile.TemporaryDirectory(prefix="kvstream-bench-snap-") as tmp:
            result = _run(settings, Path(tmp) / "snapshot", timeout)
    emit(
        {
            "bench": "restart",
            "blocks": blocks,
            "tier_blocks": tier_blocks,
            "workers": n_workers,
            "partitions": partitions,
            "records": n_records,
            "log_bytes": log_bytes,
            **result,
        },
        as_json,
    )


def _run(settings: Settings, snap: Path, timeout: float) -> dict[str, Any]:
    first = Replica(settings, replica_options(snap))
    first.start()
    try:
        wait_settled(first, settings, timeout, "first replica reading the log")
        assert first.snapshotter is not None
        with first.lock:
            t0, cpu0 = time.perf_counter(), time.process_time()
            first.snapshotter.snapshot_now(timeout)
            snapshot_write_s = time.perf_counter() - t0
            snapshot_write_cpu_s = time.process_time() - cpu0
        expected = fold_digest(first)
    finally:
        first.stop()
    del first
    gc.collect()
    snapshot_bytes = _dir_bytes(snap)

    click.echo("restarting from the snapshot...", err=True)
    restored, from_snapshot_s, from_snapshot_cpu_s = timed_start(settings, replica_options(snap), timeout)
    try:
        notes = list(restored.recovery_notes)
        tail_events = int(restored.metrics.events_applied._value.get())
        got = fold_digest(restored)
    finally:
        restored.stop()
    del restored
    gc.collect()
    if notes:
        raise click.ClickException(f"the restart did not use the snapshot cleanly: {notes}")
    if got != expected:
        raise click.ClickException(
            f"the replica restored from the snapshot differs from the one that took it: {_diff(expected, got)}"
        )
    breakdown = _restore_breakdown(snap)
    gc.collect()

    click.echo("replaying the whole log in a new replica...", err=True)
    replayed, from_replay_s, from_replay_cpu_s = timed_start(settings, replica_options(None), timeout)
    try:
        got = fold_digest(replayed)
        replayed_events = int(replayed.metrics.events_applied._value.get())
    finally:
        replayed.stop()
    if got != expected:
        raise click.ClickException(f"the replica that replayed the log differs from the one restored: {_diff(expected, got)}")
    return {
        "snapshot_write_s": round(snapshot_write_s, 3),
        "snapshot_write_cpu_s": round(snapshot_write_cpu_s, 3),
        "snapshot_bytes": snapshot_bytes,
        "ready_from_snapshot_s": round(from_snapshot_s, 3),
        "events_applied_after_restore": tail_events,
        "ready_from_replay_s": round(from_replay_s, 3),
        "events_replayed": replayed_events,
        "speedup": round(from_replay_s / from_snapshot_s, 2),
        "ready_from_snapshot_cpu_s": round(from_snapshot_cpu_s, 3),
        "ready_from_replay_cpu_s": round(from_replay_cpu_s, 3),
        "cpu_speedup": round(from_replay_cpu_s / from_snapshot_cpu_s, 2),
        "restore_breakdown_s": breakdown,
    }


def _restore_breakdown(snap: Path) -> dict[str, float]:
    """Where a restore's time goes, each stage timed alone on the committed snapshot."""
    store = SnapshotStore(snap)
    try:
        t0 = time.perf_counter()
        loaded, _ = store.load_latest()
        read_s = time.perf_counter() - t0
    finally:
        store.close()
    if loaded is None:
        raise click.ClickException("no snapshot to restore from")
    meta, blobs = loaded
    fold = LogFold(Router(), EventCodec())
    t0 = time.perf_counter()
    restore_fold(fold, meta, blobs, set(meta.partitions))
    restore_s = time.perf_counter() - t0
    return {
        # Checksums, stamps, and the tables copied and checked (WorkerTables.parse).
        "read_and_verify": round(read_s, 3),
        # The tables moved in, the owners tables built from them.
        "index_import": round(restore_s, 3),
    }
