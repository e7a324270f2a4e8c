"""A replica's start (DESIGN.md §7): the newest valid snapshot restored into the fold,
its offsets checked against the broker, and where each partition's reading starts.

What the snapshot cannot vouch for is read from the log's start and the workers
concerned are asked to resync: a partition whose snapshot offset retention already
deleted (or that is past the log's end: a recreated topic), a snapshot of a recreated
topic (another topic id), a log whose start is gone when there is no snapshot. Each
such finding is a recovery note (``/readyz``, the log).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from confluent_kafka import Consumer, KafkaException
from confluent_kafka.admin import AdminClient

from kvstream.kafka.config import admin_config
from kvstream.kafka.metadata import topic_partitions, watermarks
from kvstream.kafka.topics import topic_id
from kvstream.replica.errors import RecoveryError
from kvstream.replica.fold import LogFold
from kvstream.replica.metrics import ReplicaMetrics
from kvstream.replica.resync import Resync
from kvstream.replica.snapshot import SnapshotMeta, SnapshotStore
from kvstream.replica.snapshotter import restore_fold
from kvstream.settings import Settings

#: How long a starting replica waits for the broker's first answer (s).
CONNECT_TIMEOUT_S = 10.0
#: How long it retries reading the offsets of a topic whose leaders are being elected (s).
OFFSETS_TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True)
class PeerSource:
    """A peer replica to bootstrap an empty snapshot store from (kvstream.replica.peer)."""

    url: str
    token: str | None
    max_bytes: int
    ca_file: Path | None


@dataclass(frozen=True, slots=True)
class Recovered:
    """Where a recovered replica stands."""

    partition_count: int
    topic_id: str | None
    #: Next offset to read per partition.
    offsets: dict[int, int]
    #: Each partition's end offset at start: what is below it is the log's history.
    history_end: dict[int, int]
    #: The snapshot restored, or None (full replay).
    restored: SnapshotMeta | None
    #: Resyncs to request now, in order.
    resyncs: list[Resync]
    #: Workers dropped with what the snapshot held of them → their epoch.
    dropped: dict[int, int]


def recover(
    settings: Settings,
    topic: str,
    fold: LogFold,
    store: SnapshotStore | None,
    offsets_consumer: Consumer,
    metrics: ReplicaMetrics,
    note: Callable[[str], None],
    *,
    store_note: str | None = None,
    peer: PeerSource | None = None,
) -> Recovered:
    """Restore the newest valid snapshot of ``store`` into ``fold``, check its offsets
    against the broker (``offsets_consumer`` asks for watermarks), and say where to
    start. RecoveryError when the broker or the topic is not there."""
    partition_count = _partition_count(settings, topic)
    tid = topic_id(settings, topic)
    loaded = None
    if store_note is not None:
        metrics.snapshot_fallbacks.labels(skipped="store").inc()
        note(f"snapshot store unusable: {store_note}")
    if store is not None:
        if not store.candidates()[0] and peer is not None:
            _bootstrap_from_peer(store, peer, note)
        loaded, skipped = store.load_latest()
        for reason in skipped:
            metrics.snapshot_fallbacks.labels(skipped="generation").inc()
            note(f"snapshot skipped: {reason}")
        if loaded is None and skipped:
            metrics.snapshot_fallbacks.labels(skipped="all").inc()
            note("no snapshot generation is usable: full replay")
        if loaded is not None and (foreign := _foreign_snapshot(loaded[0], topic)) is not None:
            metrics.snapshot_fallbacks.labels(skipped="foreign").inc()
            note(f"snapshot refused: {foreign}: full replay")
            loaded = None
    bounds = read_bounds(offsets_consumer, topic, partition_count, OFFSETS_TIMEOUT_S)
    offsets = {p: low for p, (low, _) in bounds.items()}
    history_end = {p: high for p, (_, high) in bounds.items()}

    def replay(resyncs: list[Resync], dropped: dict[int, int] | None = None) -> Recovered:
        return Recovered(partition_count, tid, offsets, history_end, None, resyncs, dropped or {})

    if loaded is None:
        # Retention already dropped the start of the log: only resync can tell us what
        # workers hold.
        gone = any(low > 0 for low, _ in bounds.values())
        return replay([Resync(None, "full replay from a log whose start was deleted")] if gone else [])
    meta, blobs = loaded
    if meta.topic_id and tid and meta.topic_id != tid:
        note(f"topic id changed ({meta.topic_id} → {tid}): topic recreated")
        return replay([Resync(None, "events topic was recreated since the snapshot")],
                      {w: m.epoch for pm in meta.partitions.values() for w, m in pm.workers.items()})
    trusted = set()
    resyncs: list[Resync] = []
    dropped: dict[int, int] = {}
    for p, pm in meta.partitions.items():
        low, high = bounds.get(p, (0, 0))
        if p >= partition_count:
            why = f"partition {p} no longer exists"
        elif pm.next_offset < low:
            why = f"partition {p}: snapshot offset {pm.next_offset} < earliest {low} (retention)"
        elif pm.next_offset > high:
            why = f"partition {p}: snapshot offset {pm.next_offset} > latest {high} (topic recreated?)"
        else:
            trusted.add(p)
            offsets[p] = pm.next_offset
            continue
        note(why)
        resyncs.extend(Resync(wid, why) for wid in pm.workers)
        dropped.update({w: m.epoch for w, m in pm.workers.items()})
    restore_fold(fold, meta, blobs, trusted)
    metrics.snapshot_loaded_blocks.set(meta.blocks())
    return Recovered(partition_count, tid, offsets, history_end, meta, resyncs, dropped)


def read_bounds(consumer: Consumer, topic: str, partition_count: int, timeout: float,
                *, retry: bool = True) -> dict[int, tuple[int, int]]:
    """(earliest, end) offset of every partition (kvstream.kafka.metadata.watermarks);
    RecoveryError when the broker does not tell."""
    try:
        return watermarks(consumer, topic, range(partition_count), timeout, retry=retry)
    except KafkaException as exc:
        raise RecoveryError(f"cannot read the offsets of {topic}: {exc}") from None


def _partition_count(settings: Settings, topic: str) -> int:
    admin = AdminClient(admin_config(settings))
    try:
        partitions = topic_partitions(admin, topic, CONNECT_TIMEOUT_S)
    except KafkaException as exc:
        raise RecoveryError(
            f"cannot reach Kafka at {admin_config(settings)['bootstrap.servers']} within "
            f"{CONNECT_TIMEOUT_S:.0f} s ({exc.args[0].str() if exc.args else exc}): is the broker up "
            "(`kvstream broker start`) and the bootstrap right (--bootstrap, KVSTREAM_BOOTSTRAP)?"
        ) from None
    if not partitions:
        raise RecoveryError(f"topic {topic} is missing (create it with `kvstream topics create`)")
    return len(partitions)


def _foreign_snapshot(meta: SnapshotMeta, topic: str) -> str | None:
    """Why a snapshot was written for another topic (None: it is this one's). The
    same name with another id is this topic recreated, which recovery handles."""
    if meta.topic != topic:
        return f"it was written for topic {meta.topic}, not {topic}"
    return None


def _bootstrap_from_peer(store: SnapshotStore, peer: PeerSource, note: Callable[[str], None]) -> None:
    from kvstream.replica.peer import fetch_peer_snapshot

    try:
        gen = fetch_peer_snapshot(peer.url, store, peer.token, max_bytes=peer.max_bytes, ca_file=peer.ca_file)
        note(f"bootstrapped from peer {peer.url} (generation {gen})")
    except Exception as exc:  # any failure means: replay from the start instead
        note(f"peer bootstrap from {peer.url} failed: {exc}")
