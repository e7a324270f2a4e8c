"""A router replica: the Kafka side of the fold (DESIGN.md §6, §7).

One ingest thread consumes every partition of ``kvstream.events`` (``assign()``ed at
the snapshot's offsets, never committing), applies records to the fold under the
router lock, copies what cannot be applied to ``kvstream.dlq``, asks workers to resync
on ``kvstream.control``, publishes log-clock ticks, and advances snapshots a partition
at a time. A second thread shares load through ``kvstream.active``. The HTTP service
(kvstream.replica.service) calls ``route`` / ``prefill_done`` / ``free``.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from confluent_kafka import (
    OFFSET_END,
    Consumer,
    KafkaError,
    KafkaException,
    Producer,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient

from kvstream.events.codec import AvroCodec, EventCodec
from kvstream.events.errors import DecodeError
from kvstream.events.model import STATUS_HEADER
from kvstream.hashing import MmSpan
from kvstream.kafka.config import admin_config, consumer_config, producer_config
from kvstream.logs import get_logger
from kvstream.replica.active_codec import ActiveOpCodec
from kvstream.replica.errors import RecoveryError
from kvstream.replica.fold import TICK_HEADER, LogFold
from kvstream.replica.metrics import ReplicaMetrics
from kvstream.replica.snapshot import SnapshotStore
from kvstream.replica.snapshotter import Snapshotter, restore_fold
from kvstream.router import Router, RouterConfig
from kvstream.router.active import ActiveOp
from kvstream.router.errors import RouterError
from kvstream.router.router import RouteDecision
from kvstream.router.scheduler import SchedulerOverrides
from kvstream.settings import Settings

log = get_logger(__name__)

RESYNC_REQUEST = "kvstream.control.ResyncRequest"
_ERROR_HEADER = "kvstream-error"
_SOURCE_HEADER = "kvstream-source"


@dataclass(frozen=True, slots=True)
class ReplicaOptions:
    """How a replica runs (the ``[replica]`` section of the settings)."""

    snapshot_dir: Path | None = None
    #: Take a snapshot after this many applied records, or this many seconds (0: never).
    snapshot_every_records: int = 200_000
    snapshot_every_s: float = 60.0
    #: Ready when every partition's lag (records) is at most this.
    ready_max_lag: int = 1000
    #: Records per consume() call.
    consume_batch: int = 2000
    #: Log-clock ticks to every events partition, this often (s).
    tick_interval_s: float = 5.0
    #: Rebuild load from this much of kvstream.active at start (s); the request TTL.
    active_window_s: float = 300.0
    #: A worker is asked to resync at most this often (s).
    resync_min_interval_s: float = 10.0
    #: After a recovery that dropped workers (retention, recreated topic), stay unready
    #: until each has resynced (a newer epoch on the log), or at most this long (s).
    resync_wait_s: float = 10.0
    #: Base URL of a peer replica to bootstrap from when there is no local snapshot.
    peer_url: str | None = None
    #: Bearer token of the peer's HTTP API.
    peer_token: str | None = None
    replica_id: str = field(default_factory=lambda: f"replica-{uuid.uuid4().hex[:12]}")


class Replica:
    """Folds the events topic into a Router and answers routing calls."""

    def __init__(
        self,
        settings: Settings,
        options: ReplicaOptions | None = None,
        router_config: RouterConfig | None = None,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.options = options or ReplicaOptions()
        self.replica_id = self.options.replica_id
        self.router = Router(router_config, clock=clock)
        self.codec = AvroCodec()
        self.fold = LogFold(self.router, EventCodec(self.codec).decode)
        self.active_codec = ActiveOpCodec(self.codec)
        self.metrics = ReplicaMetrics()
        self.lock = threading.RLock()
        self.events_topic = settings.topics.name("events")
        self.store = SnapshotStore(self.options.snapshot_dir) if self.options.snapshot_dir else None
        self.snapshotter: Snapshotter | None = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._producer = Producer(producer_config(settings, **{"client.id": self.replica_id}))
        self._lag: dict[int, int] = {}
        #: worker id → its engine issues, from the newest STATUS_HEADER seen.
        self._worker_status: dict[int, dict] = {}
        self._start_offsets: dict[int, int] = {}
        self._watermarks: Consumer | None = None
        self._ready = threading.Event()
        self._last_resync: dict[int | None, float] = {}
        self._last_tick = float("-inf")
        self.topic_id: str | None = None
        self.partition_count = 0
        self.started_at = time.monotonic()
        self.ready_after_s: float | None = None
        self.recovery_notes: list[str] = []
        self._restored = None
        #: Workers dropped at recovery → the epoch they had; ready waits for newer ones.
        self._awaiting_resync: dict[int, int] = {}
        self._awaiting_until = 0.0

    # -- lifecycle -------------------------------------------------------------------

    def start(self) -> None:
        """Recover (snapshot, offset checks, resync) and start the threads."""
        offsets = self._recover()
        self._start_offsets = offsets
        self._consumer = Consumer(consumer_config(self.settings))
        self._consumer.assign(
            [TopicPartition(self.events_topic, p, o) for p, o in sorted(offsets.items())]
        )
        if self.store is not None:
            self.snapshotter = Snapshotter(
                self.store, self.fold, self.events_topic, self.topic_id, self.partition_count,
                self.options.snapshot_every_records, self.options.snapshot_every_s, self.metrics,
                base=self._restored,
            )
        self._spawn(self._ingest_loop, "ingest")
        self._spawn(self._lag_loop, "lag")
        self._spawn(self._active_loop, "active")

    def _spawn(self, target: Callable[[], None], name: str) -> None:
        t = threading.Thread(target=target, name=f"{self.replica_id}-{name}", daemon=True)
        t.start()
        self._threads.append(t)

    def stop(self) -> None:
        """Stop the threads, finish the snapshot in progress, flush producers."""
        self._stop.set()
        for t in self._threads:
            t.join(timeout=30)
        if self.snapshotter is not None:
            self.snapshotter.close(final=True)
        self._producer.flush(10)
        # Release the clients now: a stopped replica must not keep dialling the broker.
        self._producer = None  # type: ignore[assignment]
        if self._watermarks is not None:
            self._watermarks.close()
        if self.store is not None:
            self.store.close()

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    def wait_ready(self, timeout: float) -> bool:
        return self._ready.wait(timeout)

    # -- recovery --------------------------------------------------------------------

    def _recover(self) -> dict[int, int]:
        """Restore the newest valid snapshot, check its offsets against the broker, and
        return the offset to start each partition at."""
        admin = AdminClient(admin_config(self.settings))
        md = admin.list_topics(self.events_topic, timeout=30)
        tmd = md.topics.get(self.events_topic)
        if tmd is None or tmd.error is not None:
            raise RecoveryError(
                f"topic {self.events_topic} is missing (create it with `kvstream topics create`)"
            )
        self.partition_count = len(tmd.partitions)
        self.topic_id = _topic_id(admin, self.events_topic)
        loaded = None
        if self.store is not None:
            if self.store.head() is None and self.options.peer_url:
                self._bootstrap_from_peer()
            loaded, skipped = self.store.load_latest()
            for reason in skipped:
                self.metrics.snapshot_fallbacks.inc()
                self._note(f"snapshot skipped: {reason}")
        # Watermarks come from a consumer that never fetches: on the fetching one, each
        # query waits behind a long-poll fetch and stalls ingest.
        self._watermarks = Consumer(consumer_config(self.settings))
        bounds = self._bounds(timeout=30)
        offsets = {p: low for p, (low, _) in bounds.items()}
        if loaded is None:
            if any(low > 0 for low, _ in bounds.values()):
                # Retention already dropped the start of the log: only resync can tell
                # us what workers hold.
                self._request_resync(None, "full replay from a log whose start was deleted")
            return offsets
        meta, blobs = loaded
        if meta.topic_id and self.topic_id and meta.topic_id != self.topic_id:
            self._note(f"topic id changed ({meta.topic_id} → {self.topic_id}): topic recreated")
            self._request_resync(None, "events topic was recreated since the snapshot")
            self._await_resync({w: m.epoch for pm in meta.partitions.values() for w, m in pm.workers.items()})
            return offsets
        trusted = set()
        for p, pm in meta.partitions.items():
            low, high = bounds.get(p, (0, 0))
            if p >= self.partition_count:
                why = f"partition {p} no longer exists"
            elif pm.next_offset < low:
                why = f"partition {p}: snapshot offset {pm.next_offset} < earliest {low} (retention)"
            elif pm.next_offset > high:
                why = f"partition {p}: snapshot offset {pm.next_offset} > latest {high} (topic recreated?)"
            else:
                trusted.add(p)
                offsets[p] = pm.next_offset
                continue
            self._note(why)
            for wid in pm.workers:
                self._request_resync(wid, why)
            self._await_resync({w: m.epoch for w, m in pm.workers.items()})
        restore_fold(self.fold, meta, blobs, trusted)
        self._restored = meta
        self.metrics.snapshot_loaded_blocks.set(meta.blocks())
        return offsets

    def _bounds(self, timeout: float) -> dict[int, tuple[int, int]]:
        """(earliest, end) offset of every partition; retried while a new topic's
        leaders are still being elected."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return {
                    p: self._watermarks.get_watermark_offsets(
                        TopicPartition(self.events_topic, p), timeout=5, cached=False
                    )
                    for p in range(self.partition_count)
                }
            except KafkaException as exc:
                if time.monotonic() > deadline:
                    raise RecoveryError(f"cannot read the offsets of {self.events_topic}: {exc}") from None
                time.sleep(0.2)

    def _await_resync(self, dropped: dict[int, int]) -> None:
        self._awaiting_resync.update(dropped)
        self._awaiting_until = time.monotonic() + self.options.resync_wait_s

    def _resyncs_pending(self) -> bool:
        """Whether a worker dropped at recovery has not resynced yet (and the wait for it
        has not run out): until then the replica would route without it."""
        if not self._awaiting_resync:
            return False
        with self.lock:
            workers = self.fold.workers
            for wid, epoch in list(self._awaiting_resync.items()):
                if wid in workers and workers[wid].epoch > epoch:
                    del self._awaiting_resync[wid]
        if self._awaiting_resync and time.monotonic() >= self._awaiting_until:
            self._note(f"workers did not resync within {self.options.resync_wait_s}s: {sorted(self._awaiting_resync)}")
            self._awaiting_resync.clear()
        return bool(self._awaiting_resync)

    def _bootstrap_from_peer(self) -> None:
        from kvstream.replica.peer import fetch_peer_snapshot

        assert self.store is not None and self.options.peer_url
        try:
            gen = fetch_peer_snapshot(self.options.peer_url, self.store, self.options.peer_token)
            self._note(f"bootstrapped from peer {self.options.peer_url} (generation {gen})")
        except Exception as exc:  # any failure means: replay from the start instead
            self._note(f"peer bootstrap from {self.options.peer_url} failed: {exc}")

    def _note(self, text: str) -> None:
        self.recovery_notes.append(text)
        log.warning("recovery", replica=self.replica_id, note=text)

    # -- ingest ----------------------------------------------------------------------

    def _ingest_loop(self) -> None:
        consumer = self._consumer
        try:
            while not self._stop.is_set():
                # Wait for one record, then take what is already there: low lag when
                # quiet, large batches under load.
                msgs = consumer.consume(1, 0.05)
                if msgs:
                    msgs += consumer.consume(self.options.consume_batch - 1, 0)
                    with self.lock:
                        self._apply_messages(msgs)
                if self.snapshotter is not None:
                    with self.lock:
                        self.snapshotter.step()
                self._housekeeping()
        except Exception:  # never die silently: a dead ingest thread must be visible
            log.exception("ingest loop failed", replica=self.replica_id)
            self._ready.clear()
            raise
        finally:
            consumer.close()

    def _apply_messages(self, msgs: list) -> None:
        fold = self.fold
        m_applied = 0
        records = 0
        for m in msgs:
            err = m.error()
            if err is not None:
                if err.code() != KafkaError._PARTITION_EOF:
                    self.metrics.consume_errors.inc()
                    log.warning("consume error", error=str(err))
                continue
            records += 1
            headers = m.headers()
            is_tick = bool(headers) and any(k == TICK_HEADER for k, _ in headers)
            if headers:
                self._note_worker_status(m.key(), headers)
            out = fold.apply_record(m.partition(), m.offset(), m.timestamp()[1], m.value(), is_tick)
            m_applied += out.applied_events
            if out.dlq_reason is not None:
                self._to_dlq(m, out.dlq_reason)
            for wid in out.resync:
                self._request_resync(wid, "event id gap or epoch without cleared")
        self.metrics.events_applied.inc(m_applied)
        self.metrics.records.inc(records)
        if self.snapshotter is not None and records:
            self.snapshotter.records_applied(records)

    def _to_dlq(self, m, reason: str) -> None:
        self.metrics.dlq.inc()
        headers = list(m.headers() or [])
        headers += [
            (_ERROR_HEADER, reason[:2000].encode()),
            (_SOURCE_HEADER, f"{m.topic()}/{m.partition()}/{m.offset()}".encode()),
        ]
        self._producer.produce(
            self.settings.topics.name("dlq"), value=m.value(), key=m.key(), headers=headers,
            on_delivery=self._delivery,
        )
        self._producer.poll(0)

    def _delivery(self, err, _msg) -> None:
        if err is not None:
            self.metrics.produce_failures.inc()
            log.error("produce failed", error=str(err))

    def _request_resync(self, worker_id: int | None, reason: str) -> None:
        now = time.monotonic()
        last = self._last_resync.get(worker_id)
        if last is not None and now - last < self.options.resync_min_interval_s:
            return
        self._last_resync[worker_id] = now
        self.metrics.resync_requests.inc()
        wid = None if worker_id is None else (worker_id - (1 << 64) if worker_id >= 1 << 63 else worker_id)
        value = self.codec.encode(
            RESYNC_REQUEST,
            {"worker_id": wid, "requester": self.replica_id, "reason": reason,
             "requested_at_ms": int(time.time() * 1000)},
        )
        self._producer.produce(self.settings.topics.name("control"), value=value, on_delivery=self._delivery)
        self._producer.poll(0)

    def _housekeeping(self) -> None:
        now = time.monotonic()
        if now - self._last_tick >= self.options.tick_interval_s:
            self._last_tick = now
            for p in range(self.partition_count):
                self._producer.produce(self.events_topic, value=None, partition=p, headers=[(TICK_HEADER, b"")])
        self._producer.poll(0)

    def _lag_loop(self) -> None:
        # Its own thread: a slow broker answer must never stall ingest.
        while not self._stop.is_set():
            self._update_lag()
            self._stop.wait(0.5)

    def _update_lag(self) -> None:
        with self.lock:
            offsets = self.fold.next_offsets()
        try:
            bounds = self._bounds(timeout=0)
        except RecoveryError:
            return  # broker unreachable: keep the last view; readiness unchanged
        lag = {}
        for p, (_, high) in bounds.items():
            pos = offsets.get(p, self._start_offsets.get(p, 0))
            lag[p] = max(0, high - pos)
            self.metrics.lag.labels(partition=str(p)).set(lag[p])
        self._lag = lag
        if all(v <= self.options.ready_max_lag for v in lag.values()) and not self._resyncs_pending():
            if not self._ready.is_set():
                self.ready_after_s = time.monotonic() - self.started_at
                log.info("ready", replica=self.replica_id, after_s=round(self.ready_after_s, 3))
            self._ready.set()
        else:
            self._ready.clear()

    def lag(self) -> dict[int, int]:
        return dict(self._lag)

    def _note_worker_status(self, key: bytes | None, headers: list) -> None:
        """A worker's engine issues (STATUS_HEADER), shown by /v1/workers."""
        for k, v in headers:
            if k == STATUS_HEADER and key is not None and len(key) == 8:
                try:
                    status = json.loads(v)
                except ValueError:
                    continue  # advisory only: a bad header changes nothing
                if isinstance(status, dict):
                    self._worker_status[int.from_bytes(key, "big")] = status

    def workers_view(self) -> dict[str, object]:
        """Per worker: blocks per rank and tier, epoch, last event ids, partition lag."""
        with self.lock:
            sizes = self.router.index.tree_sizes()
            out: dict[str, dict] = {}
            for key, tiers in sizes.items():
                w = out.setdefault(str(key.worker_id), {"ranks": {}})
                w["ranks"][str(key.dp_rank)] = {t.value: n for t, n in tiers.items()}
            for wid, wlog in self.fold.workers.items():
                w = out.setdefault(str(wid), {"ranks": {}})
                w.update(
                    epoch=wlog.epoch,
                    last_event_ids={str(r): i for r, i in wlog.last_ids.items()},
                    partition=wlog.partition,
                    lag=self._lag.get(wlog.partition),
                    last_seen_ms=wlog.last_seen_ms,
                    engine_issues=self._worker_status.get(wid, {}),
                )
        return {"replica_id": self.replica_id, "ready": self.ready, "workers": out}

    # -- load sharing ----------------------------------------------------------------

    def _active_loop(self) -> None:
        topic = self.settings.topics.name("active")
        consumer = Consumer(consumer_config(self.settings, **{"auto.offset.reset": "latest"}))
        try:
            md = consumer.list_topics(topic, timeout=30).topics.get(topic)
            if md is None or md.error is not None:
                log.error("active topic missing; load is not shared", topic=topic)
                return
            since_ms = int((time.time() - self.options.active_window_s) * 1000)
            tps = consumer.offsets_for_times(
                [TopicPartition(topic, p, since_ms) for p in md.partitions], timeout=30
            )
            consumer.assign([tp if tp.offset >= 0 else TopicPartition(topic, tp.partition, OFFSET_END) for tp in tps])
            while not self._stop.is_set():
                for m in consumer.consume(500, 0.1):
                    if m.error() is not None:
                        continue
                    self._apply_peer_op(m.value())
        finally:
            consumer.close()

    def _apply_peer_op(self, value: bytes | None) -> None:
        try:
            if value is None:
                raise DecodeError("active op record has no value")
            replica_id, op = self.active_codec.decode(value)
        except DecodeError as exc:
            self.metrics.active_errors.labels(reason="undecodable").inc()
            log.warning("bad active op", error=str(exc))
            return
        if replica_id == self.replica_id:
            return
        with self.lock:
            try:
                self.router.apply_active(op)
                self.metrics.active_ops.labels(source="peer").inc()
            except RouterError as exc:  # e.g. free of a request that already expired here
                self.metrics.active_errors.labels(reason=type(exc).__name__).inc()

    def _share(self, op: ActiveOp) -> None:
        self.metrics.active_ops.labels(source="local").inc()
        self._producer.produce(
            self.settings.topics.name("active"),
            value=self.active_codec.encode(self.replica_id, op),
            key=op.request_id.encode(),
            on_delivery=self._delivery,
        )
        self._producer.poll(0)

    # -- requests --------------------------------------------------------------------

    def route(
        self,
        token_ids: list[int],
        lora_name: str | None = None,
        request_id: str | None = None,
        query_only: bool = False,
        overrides: SchedulerOverrides | None = None,
        *,
        cache_salt: str | None = None,
        mm: Sequence[MmSpan] = (),
    ) -> RouteDecision:
        with self.lock:
            decision = self.router.find_best_match(
                token_ids, lora_name, request_id, query_only, overrides, cache_salt=cache_salt, mm=mm
            )
        if decision.op is not None:
            self._share(decision.op)
        return decision

    def prefill_done(self, request_id: str) -> None:
        with self.lock:
            op = self.router.prefill_done(request_id)
        self._share(op)

    def free(self, request_id: str) -> None:
        with self.lock:
            op = self.router.free(request_id)
        self._share(op)


def _topic_id(admin: AdminClient, topic: str) -> str | None:
    """The topic's id (changes when a topic is deleted and recreated)."""
    from confluent_kafka import TopicCollection

    try:
        futures = admin.describe_topics(TopicCollection([topic]), request_timeout=30)
        desc = futures[topic].result()
    except KafkaException:
        return None
    tid = getattr(desc, "topic_id", None)
    return str(tid) if tid is not None else None
