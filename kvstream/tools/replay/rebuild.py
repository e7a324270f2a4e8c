"""``replay rebuild``: the index exactly as a replica had it at a time T.

A replica's state is the fold of each partition's prefix; as of T that prefix ends at
the first record stamped after T (kvstream.tools.replay.reader). The fold starts from
the newest snapshot of ``--snapshot-dir`` that is not past T (each partition's stored
next offset within the prefix), else from the start of the log, and is the replica's
own :class:`~kvstream.replica.fold.LogFold`, so the result is the replica's state.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from kvstream.events.codec import EventCodec
from kvstream.events.model import Tier
from kvstream.kafka.topics import topic_id
from kvstream.replica.cli import router_config
from kvstream.replica.authority import authority_from_settings
from kvstream.replica.errors import SnapshotError
from kvstream.replica.fold import LogFold, PackedReader
from kvstream.replica.snapshot import SnapshotMeta, SnapshotStore
from kvstream.replica.snapshotter import Snapshotter, restore_fold
from kvstream.router import Router
from kvstream.router.active import ActiveOp
from kvstream.router.errors import RouterError
from kvstream.settings import Settings
from kvstream.tools.replay.errors import RetentionError, SourceError
from kvstream.replica.record import Record
from kvstream.tools.replay.reader import LogReader, format_time


def new_fold(settings: Settings, at_s: float, reader: PackedReader | None = None) -> LogFold:
    """An empty fold with the settings' router, whose clock stands still at ``at_s`` (so
    that request and prediction expiry is evaluated as of the replayed time) and records
    read by ``reader`` (an EventCodec by default)."""
    return LogFold(
        Router(router_config(settings), clock=lambda: at_s), reader or EventCodec(), authority_from_settings(settings.fold),
    )


class TimedOp(Protocol):
    """An active op as read from the log, with its time."""

    timestamp_ms: int
    op: ActiveOp


def fold_records(fold: LogFold, records: Iterable[Record], ops: Sequence[TimedOp] = ()) -> tuple[int, int]:
    """Apply records, and the active ops ``ops`` (in time order) among them as a replica
    caught up with both logs met them: each op after every record stamped at or before
    it, each partition's records in offset order. The order matters: a worker's expiry
    drops the requests routed to it before, a store confirms a prediction made before
    it, a new incarnation drops them. Returns (records folded, ops the router refused:
    e.g. the free of a request added before the window, or dropped with its worker)."""
    n = refused = 0
    apply = fold.apply
    router = fold.router
    first = ops[0].timestamp_ms if ops else None
    # Records before the first op are folded as they come; from there each partition's
    # are held, to be merged with the ops by time.
    held: dict[int, deque[Record]] = {}
    for r in records:
        q = held.get(r.partition)
        if q is None and (first is None or r.timestamp_ms <= first):
            apply(r)
            n += 1
        else:
            held.setdefault(r.partition, deque()).append(r)
    heads = [(q[0].timestamp_ms, p) for p, q in held.items()]
    heapq.heapify(heads)

    def fold_until(ms: float) -> None:
        nonlocal n
        while heads and heads[0][0] <= ms:
            _, p = heapq.heappop(heads)
            q = held[p]
            apply(q.popleft())
            n += 1
            if q:
                heapq.heappush(heads, (q[0].timestamp_ms, p))

    for o in ops:
        fold_until(o.timestamp_ms)
        try:
            router.apply_active(o.op)
        except RouterError:
            refused += 1
    fold_until(math.inf)
    return n, refused


@dataclass(slots=True)
class Rebuilt:
    """A fold as of ``at_ms`` and where it came from."""

    fold: LogFold
    at_ms: int
    #: "snapshot generation N of DIR" or "start of the log".
    source: str
    #: Per partition, the first offset not folded (the prefix end of T).
    end_offsets: dict[int, int]
    records: int
    partition_count: int
    topic: str
    #: The topic's id (recorded in a written snapshot, so that a replica of another
    #: topic, or of this one recreated, tells it apart).
    topic_id: str | None = None
    notes: list[str] = field(default_factory=list)
    #: Active ops folded among the records, and how many of them the router refused.
    ops: int = 0
    ops_refused: int = 0


def open_store(path: Path) -> SnapshotStore:
    if not path.is_dir():
        raise SourceError(f"snapshot directory {path} does not exist")
    try:
        return SnapshotStore(path, read_only=True)
    except SnapshotError as exc:
        raise SourceError(str(exc)) from None


def _usable_snapshot(
    store: SnapshotStore, reader: LogReader, tid: str | None, end: dict[int, int], notes: list[str]
) -> tuple[SnapshotMeta, dict[int, bytes]] | None:
    """The newest generation whose every partition stops within the prefix of T."""
    head = store.head()
    if head is None:
        raise SourceError(f"{store.path} holds no committed snapshot")
    readable = 0
    for gen in head:
        if not gen:
            continue
        try:
            meta, blobs = store.load(gen)
        except SnapshotError as exc:
            notes.append(f"snapshot generation {gen} unreadable: {exc}")
            continue
        readable += 1
        if meta.topic != reader.topic:
            notes.append(f"snapshot generation {gen} is of topic {meta.topic}, not {reader.topic}")
            continue
        if meta.topic_id and tid and meta.topic_id != tid:
            notes.append(f"snapshot generation {gen} is of topic id {meta.topic_id}, not {tid} (recreated)")
            continue
        late = [
            p for p, pm in meta.partitions.items()
            if p not in end or not reader.low[p] <= pm.next_offset <= end[p]
        ]
        if late:
            notes.append(
                f"snapshot generation {gen} is past the asked time (or outside retention) on "
                f"partition(s) {late}"
            )
            continue
        return meta, blobs
    if not readable:
        raise SourceError(f"no readable snapshot in {store.path}: {'; '.join(notes)}")
    return None


def rebuild_at(
    settings: Settings,
    at_ms: int,
    snapshot_dir: Path | None = None,
    *,
    progress: bool | None = None,
    ops: Sequence[TimedOp] = (),
) -> Rebuilt:
    """Fold the events topic up to ``at_ms`` (inclusive), with the active ops ``ops``
    (in time order) among its records (:func:`fold_records`)."""
    with LogReader(settings, "events") as reader:
        end = reader.offsets_after(at_ms)
        notes: list[str] = []
        tid = topic_id(settings, reader.topic, timeout=reader.timeout)
        fold = new_fold(settings, at_ms / 1000)
        start = {p: 0 for p in reader.partitions}
        source = "start of the log"
        if snapshot_dir is not None:
            store = open_store(snapshot_dir)
            try:
                picked = _usable_snapshot(store, reader, tid, end, notes)
            finally:
                store.close()
            if picked is not None:
                meta, blobs = picked
                restore_fold(fold, meta, blobs, set(meta.partitions))
                start.update(meta.next_offsets())
                source = f"snapshot generation {meta.gen} of {snapshot_dir}"
        lost = [p for p in reader.partitions if start[p] < reader.low[p]]
        if lost:
            before = all(end[p] == reader.low[p] for p in lost)
            raise RetentionError(
                (f"{format_time(at_ms)} is before the retention horizon of {reader.topic}"
                 if before else
                 f"the start of {reader.topic} was deleted by retention")
                + f" (partition(s) {lost} keep offsets from "
                + ", ".join(str(reader.low[p]) for p in lost)
                + "): the state cannot be rebuilt from the log alone; pass --snapshot-dir "
                "with a snapshot taken before that time"
            )
        n, refused = fold_records(fold, reader.read(start, end, progress=progress, desc="rebuild"), ops)
        # The prefix may end on records that carry no data (transaction markers), and a
        # partition may have nothing to read: the fold must still resume at the end.
        for p, e in end.items():
            part = fold.partitions.get(p)
            if (part.next_offset if part else 0) < e:
                fold.restore_partition(p, e, part.log_time_ms if part else 0)
        if source != "start of the log" and ops:
            notes.append("the active ops stamped before the snapshot's records are applied after them")
        return Rebuilt(fold, at_ms, source, end, n, len(reader.partitions), reader.topic, tid, notes, len(ops), refused)


def summary(fold: LogFold) -> list[dict[str, Any]]:
    """One row per (worker, dp_rank): blocks per tier, and the worker's epoch, partition,
    last event id of the rank, last seen (log time)."""
    rows = []
    sizes = fold.router.tree_sizes()
    for key in sorted(sizes):
        wlog = fold.workers.get(key.worker_id)
        rows.append(
            {
                "worker_id": key.worker_id,
                "dp_rank": key.dp_rank,
                **{t.value: sizes[key].get(t, 0) for t in Tier},
                "epoch": wlog.epoch if wlog else None,
                "partition": wlog.partition if wlog else None,
                "last_event_id": wlog.last_ids.get(key.dp_rank) if wlog else None,
                "last_seen": format_time(wlog.last_seen_ms) if wlog else None,
            }
        )
    return rows


def write_snapshot(rebuilt: Rebuilt, path: Path) -> int:
    """Write the rebuilt state as a snapshot generation a replica can start from."""
    try:
        store = SnapshotStore(path)
    except SnapshotError as exc:
        raise SourceError(str(exc)) from None
    try:
        if store.head() is not None:
            raise SourceError(f"{path} already holds snapshots: write into a new directory")
        snap = Snapshotter(store, rebuilt.fold, rebuilt.topic, rebuilt.topic_id, rebuilt.partition_count, 0, 0)
        try:
            return snap.snapshot_now()
        finally:
            snap.close()
    finally:
        store.close()
