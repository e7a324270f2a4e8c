"""Taking snapshots of a running fold without stalling it, and restoring one.

The ingest thread calls :meth:`Snapshotter.step` between consume batches. When a
snapshot is due, each step captures ONE partition (its offset, log clock and the workers
on it, exporting only the workers changed since the last snapshot) and hands it to a
writer thread; after the last partition the writer commits the generation atomically.
Since every worker lives on one partition, each captured part is consistent with its
own offset, whatever the other partitions did in between. One generation is in flight at
a time: the next begins once the last is committed (or abandoned), because a worker it
does not rewrite points at the blob of the last committed one, and a generation still
being written may have taken that worker's newer state off the dirty set.

A failed write (disk full, an I/O error) abandons its generation whole: the store is
reopened (RocksDB refuses every write after one failed until then), the next generation
rewrites every worker (the failed one had taken them off the dirty set, so pointing at
older blobs would lose their changes) and is retried after a backoff even if no record
arrives. Serving never depends on it.
"""

from __future__ import annotations

import queue
import threading
import time

from kvstream.logs import get_logger
from kvstream.replica.errors import SnapshotError
from kvstream.replica.fold import LogFold, WorkerLog
from kvstream.replica.metrics import ReplicaMetrics
from kvstream.replica.snapshot import (
    BlobRef,
    PartitionMeta,
    SnapshotMeta,
    SnapshotStore,
    WorkerMeta,
)
from kvstream.router.index import WorkerTables

log = get_logger(__name__)

_PENDING = BlobRef(0, 0, 0)  # filled in by the writer thread
#: Backoff between retries of a failed generation (doubles up to the maximum), seconds.
RETRY_MIN_S = 0.5
RETRY_MAX_S = 30.0


class Snapshotter:
    def __init__(
        self,
        store: SnapshotStore,
        fold: LogFold,
        topic: str,
        topic_id: str | None,
        partition_count: int,
        every_records: int,
        every_s: float,
        metrics: ReplicaMetrics | None = None,
        base: SnapshotMeta | None = None,
    ) -> None:
        self.store = store
        self.fold = fold
        self.topic = topic
        self.topic_id = topic_id
        self.partition_count = partition_count
        self.every_records = every_records
        self.every_s = every_s
        self.metrics = metrics
        #: The last committed (or restored) generation: unchanged workers point into it.
        self.base = base
        self._records = 0
        self._last_commit = time.monotonic()
        self._meta: SnapshotMeta | None = None
        self._last_gen = 0
        self._todo: list[int] = []
        self._started = 0.0
        self._forced = False
        #: Set by the writer after a failed generation: the next one rewrites every
        #: worker, no earlier than ``_retry_at`` (monotonic).
        self._failed = threading.Event()
        self._retry_at = 0.0
        self._backoff = RETRY_MIN_S
        self._bad_gen = 0
        self.failures = 0
        self._queue: queue.Queue = queue.Queue(maxsize=4)
        self._committed = threading.Condition()
        self._writer = threading.Thread(target=self._write_loop, name="snapshot-writer", daemon=True)
        self._writer.start()
        self.error: BaseException | None = None

    # -- ingest thread ---------------------------------------------------------------

    def records_applied(self, n: int) -> None:
        self._records += n

    def due(self) -> bool:
        if not self._settled():
            return False
        if self._forced:
            return True
        if self._failed.is_set():
            return time.monotonic() >= self._retry_at
        if self.every_records and self._records >= self.every_records:
            return True
        return bool(self.every_s) and self._records > 0 and time.monotonic() - self._last_commit >= self.every_s

    def pending(self) -> bool:
        """Whether :meth:`step` has anything to do: a snapshot in progress or due (asked
        by the ingest thread, which owns this state, without the fold's lock)."""
        return self._meta is not None or self.due()

    def step(self) -> None:
        """Capture one partition of the snapshot in progress (starting one when due)."""
        if self._meta is None:
            if not self.due():
                return
            self._begin()
        assert self._meta is not None
        p = self._todo.pop()
        self._capture(self._meta, p)
        if not self._todo:
            self._queue.put(("commit", self._meta))
            self._meta = None

    def snapshot_now(self, timeout: float = 300.0) -> int:
        """Capture every partition now and wait for the commit; returns the generation.
        Call from the thread that owns the fold (or with the ingest stopped)."""
        self._forced = True
        if self._meta is None:
            self._wait(self._settled, timeout)
            self._begin()
        gen = self._meta.gen  # type: ignore[union-attr]
        while self._meta is not None:
            self.step()
        self.wait_committed(gen, timeout)
        return gen

    def _begin(self) -> None:
        # An abandoned generation's number is not in the store: count locally too.
        gen = max(self.store.next_gen(), (self.base.gen + 1) if self.base else 1, self._last_gen + 1)
        with self._committed:  # against _write_failed: this generation is full or abandoned
            self._last_gen = gen
            full = self._failed.is_set()
            self._failed.clear()
        if full:
            self.fold.dirty.update(self.fold.workers)
        self._meta = SnapshotMeta(
            gen, self.topic, self.topic_id, self.partition_count, int(time.time() * 1000),
            counters=self.fold.rejections(),
        )
        parts = set(range(self.partition_count)) | set(self.fold.partitions)
        self._todo = sorted(parts, reverse=True)
        self._records = 0
        self._forced = False
        self._started = time.monotonic()
        # Workers removed since the last snapshot are simply absent from this one.
        self.fold.dirty.intersection_update(self.fold.workers)

    def _capture(self, meta: SnapshotMeta, p: int) -> None:
        fold = self.fold
        part = fold.partitions.get(p)
        pm = meta.partitions[p] = PartitionMeta(
            part.next_offset if part else 0, part.log_time_ms if part else 0
        )
        base_workers = self.base.partitions[p].workers if self.base and p in self.base.partitions else {}
        router = fold.router
        blobs = []
        for wid, wlog in fold.workers.items():
            if wlog.partition != p:
                continue
            base = None if wid in fold.dirty else base_workers.get(wid)
            wm = pm.workers[wid] = WorkerMeta(
                wlog.epoch, wlog.lease_ms, wlog.last_seen_ms, dict(wlog.last_ids), base.blob if base else _PENDING,
                {r: dict(d) for r, d in wlog.recent.items()}, wlog.stored,
                base.blocks if base else router.worker_blocks(wid),
            )
            if base is None:
                blobs.append((wid, wm.stamp(wid) + router.export_tables(wid)))
                fold.dirty.discard(wid)
        self._queue.put(("blobs", meta.gen, pm, blobs))

    # -- writer thread ---------------------------------------------------------------

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            gen = item[1] if item[0] == "blobs" else item[1].gen
            if gen <= self._bad_gen:
                continue  # the rest of a generation that was abandoned
            try:
                if item[0] == "blobs":
                    _, gen, pm, blobs = item
                    for wid, blob in blobs:
                        pm.workers[wid].blob = self.store.write_blob(wid, gen, blob)
                else:
                    self._commit(item[1])
            except Exception as exc:  # keep the replica serving; a later generation retries
                self._write_failed(gen, exc)

    def _commit(self, meta: SnapshotMeta) -> None:
        self.store.commit(meta, self.base.gen if self.base else 0)
        with self._committed:
            self.base = meta
            self._last_commit = time.monotonic()
            self._backoff = RETRY_MIN_S
            self._committed.notify_all()
        if self.metrics is not None:
            self.metrics.snapshot_committed(meta, time.monotonic() - self._started)
        log.info("snapshot committed", gen=meta.gen, blocks=meta.blocks())

    def _write_failed(self, gen: int, exc: Exception) -> None:
        self.failures += 1
        if self.metrics is not None:
            self.metrics.snapshot_write_failures.inc()
        log.error("snapshot write failed; generation abandoned", gen=gen, error=str(exc), retry_in_s=self._backoff)
        try:
            self.store.reopen()
        except SnapshotError as reopen_exc:  # e.g. still no space: the retry reopens again
            log.error("snapshot store reopen failed", error=str(reopen_exc))
        with self._committed:
            # Every generation begun so far was captured against the failed one's dirty
            # set: abandon them all; the next to begin rewrites every worker.
            self._bad_gen = max(gen, self._last_gen)
            self.error = exc
            self._retry_at = time.monotonic() + self._backoff
            self._backoff = min(self._backoff * 2, RETRY_MAX_S)
            self._failed.set()
            self._committed.notify_all()

    def _settled(self) -> bool:
        """Whether the last generation begun is committed or abandoned."""
        with self._committed:
            return self._last_gen <= max(self.base.gen if self.base else 0, self._bad_gen)

    def wait_committed(self, gen: int, timeout: float) -> None:
        """Wait until generation ``gen`` (or a newer one) is committed; SnapshotError if
        it failed, TimeoutError if it takes longer than ``timeout``."""

        def committed() -> bool:
            if self._bad_gen >= gen:
                raise SnapshotError(f"snapshot generation {gen} failed: {self.error}")
            return self.base is not None and self.base.gen >= gen

        self._wait(committed, timeout, f"snapshot generation {gen} not committed in {timeout}s")

    def _wait(self, done, timeout: float, what: str = "") -> None:
        deadline = time.monotonic() + timeout
        with self._committed:
            while not done():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(what or f"the snapshot in flight not settled in {timeout}s")
                self._committed.wait(left)

    def close(self, final: bool = False, attempts: int = 3) -> bool:
        """Finish the snapshot in progress (with ``final``, take one more of whatever
        changed since, so that a clean restart replays nothing; tried ``attempts``
        times), then stop the writer. Never raises: returns whether the final snapshot
        (if asked for) was committed; a failed one only means a longer replay."""
        ok = True
        while self._meta is not None:
            self.step()
        if final and (self._records or self.fold.dirty or self._failed.is_set()):
            ok = False
            for attempt in range(attempts):
                try:
                    self.snapshot_now()
                    ok = True
                    break
                except (SnapshotError, TimeoutError) as exc:
                    log.error("final snapshot failed", attempt=attempt + 1, error=str(exc))
        self._queue.put(None)
        self._writer.join()
        return ok


def restore_fold(
    fold: LogFold, meta: SnapshotMeta, blobs: dict[int, WorkerTables], partitions: set[int]
) -> None:
    """Load the given partitions of a verified snapshot into an empty fold (the index's
    tables in one step, once every worker is known)."""
    imports: dict[int, WorkerTables] = {}
    for p in partitions:
        pm = meta.partitions[p]
        fold.restore_partition(p, pm.next_offset, pm.log_time_ms)
        for wid, wm in pm.workers.items():
            if fold.restore_worker(
                wid, WorkerLog(
                    p, wm.epoch, wm.lease_ms, wm.last_seen_ms, dict(wm.last_ids),
                    {r: dict(d) for r, d in wm.recent.items()}, wm.stored,
                )
            ):
                imports[wid] = blobs[wid]
    fold.router.import_workers(imports)
