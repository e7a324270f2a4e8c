"""A router replica: the Kafka side of the fold (DESIGN.md §6, §7).

One ingest thread consumes every partition of ``kvstream.events`` (``assign()``ed at
the snapshot's offsets, never committing), applies records to the fold under the
router lock, copies what cannot be applied to ``kvstream.dlq``, asks workers to resync
on ``kvstream.control``, publishes log-clock ticks, and advances snapshots a partition
at a time. A second thread shares load through ``kvstream.active``. The HTTP service
(kvstream.replica.service) calls ``route`` / ``prefill_done`` / ``free``.

Every thread runs under a :class:`~kvstream.replica.supervisor.Supervisor`: a failure is
logged, counted, shown on ``/readyz`` and retried with backoff; one that keeps failing
makes the replica give up (``kvstream router`` exits non-zero). No record can stop
ingest: the fold dead-letters what it cannot apply, a DLQ copy is bounded (a large
record is referenced by topic/partition/offset, size and digest), and a refused
produce is counted and logged, never raised. Partitions added to the events topic
while the replica runs are found by a periodic metadata check and read from their
start.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path

from confluent_kafka import (
    OFFSET_BEGINNING,
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
from kvstream.gateway.registry import RegistrationCodec, WorkerRegistry
from kvstream.hashing import MmSpan
from kvstream.kafka.config import admin_config, consumer_config, producer_config
from kvstream.kafka.topics import topic_id
from kvstream.logs import get_logger
from kvstream.replica.active_codec import ActiveOpCodec
from kvstream.replica.admission import admission_from_settings
from kvstream.replica.authority import authority_from_settings
from kvstream.replica.errors import AmbiguousRequestError, RecoveryError
from kvstream.replica.fold import FOLD_SLICE, LogFold, fold_in_slices
from kvstream.replica.metrics import ReplicaMetrics
from kvstream.replica.positions import PositionCommitter, commit_callback, replica_group_id
from kvstream.replica.request_ids import scoped, unscoped
from kvstream.replica.snapshot import SnapshotMeta, SnapshotStore, open_store
from kvstream.replica.snapshotter import Snapshotter, restore_fold
from kvstream.replica.supervisor import RestartPolicy, Supervisor
from kvstream.replica.record import Record, read_record
from kvstream.replica.ticks import TickCodec, Ticker
from kvstream.router import Router, RouterConfig
from kvstream.router.active import ActiveOp, AddRequest, FreeRequest
from kvstream.router.core import PromptTokens
from kvstream.router.errors import RouterError, UnknownRequestError
from kvstream.router.index import WorkerKey
from kvstream.router.router import RouteDecision
from kvstream.router.scheduler import SchedulerOverrides
from kvstream.settings import Settings

log = get_logger(__name__)

RESYNC_REQUEST = "kvstream.control.ResyncRequest"
_ERROR_HEADER = "kvstream-error"
_SOURCE_HEADER = "kvstream-source"
#: How long a starting replica waits for the broker's first answer (s).
CONNECT_TIMEOUT_S = 10.0
#: On a DLQ record that references a too-large original instead of copying it.
_REF_HEADER = "kvstream-dlq-reference"
#: On a load op: which running instance of a replica id sent it ("<start ms>:<uuid>").
_INSTANCE_HEADER = "kvstream-instance"
#: On an active op that a replica published for the peer that owns the request.
_SENDER_HEADER = "kvstream-sender"


@dataclass(frozen=True, slots=True)
class ReplicaOptions:
    """How a replica runs (the ``[replica]`` section of the settings)."""

    snapshot_dir: Path | None = None
    #: Take a snapshot after this many applied records, or this many seconds (0: never).
    snapshot_every_records: int = 200_000
    snapshot_every_s: float = 60.0
    #: Ready when every partition's lag (records) is at most this. Once ready, a replica
    #: that falls further behind (a burst: every replica at once) keeps routing, each
    #: decision marked stale, unless ``refuse_when_stale``: a slightly stale index routes
    #: far better than none.
    ready_max_lag: int = 1000
    refuse_when_stale: bool = False
    #: Records per consume() call.
    consume_batch: int = 2000
    #: Records folded between looks at the clock under the router lock, which ingest
    #: holds for about kvstream.replica.fold.FOLD_HOLD_S at a time (FOLD_SLICE).
    fold_slice: int = FOLD_SLICE
    #: How often to look for partitions that need a log-clock tick (kvstream.replica.ticks).
    tick_interval_s: float = 5.0
    #: Rebuild load from this much of kvstream.active at start (s); the request TTL.
    active_window_s: float = 300.0
    #: A worker is asked to resync at most this often (s).
    resync_min_interval_s: float = 10.0
    #: After a recovery that dropped workers (retention, recreated topic), stay unready
    #: until each has resynced (a newer epoch on the log), or at most this long (s).
    resync_wait_s: float = 10.0
    #: Commit read positions to this replica's own consumer group this often (s), for
    #: Kafka's lag tooling (kvstream.replica.positions); 0: never.
    commit_interval_s: float = 1.0
    #: Base URL of a peer replica to bootstrap from when there is no local snapshot.
    peer_url: str | None = None
    #: Bearer token of the peer's HTTP API (with its peer scope).
    peer_token: str | None = None
    #: Largest peer snapshot accepted (bytes); CA bundle that verifies an https peer.
    peer_max_bytes: int = 16 * 1024**3
    peer_ca_file: Path | None = None
    #: A record (value, key and headers) larger than this is referenced in the DLQ, not
    #: copied: far below the producer's message.max.bytes (1 MB by default).
    dlq_max_bytes: int = 256 * 1024
    #: How often the events topic's partition count is checked (s).
    metadata_interval_s: float = 10.0
    #: A thread restarts after this (s), doubling up to ``thread_max_backoff_s``; a
    #: critical one that fails ``thread_max_failures`` times without progress is fatal.
    thread_backoff_s: float = 0.5
    thread_max_backoff_s: float = 30.0
    thread_max_failures: int = 5
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
        on_fatal: Callable[[str], None] | None = None,
    ) -> None:
        """``on_fatal(reason)`` is called (from a replica thread) when the replica gives
        up: ``kvstream router`` stops its server and exits non-zero."""
        self.settings = settings
        self.options = options or ReplicaOptions()
        self.replica_id = self.options.replica_id
        #: This process's instance of ``replica_id``: (start, random) orders two of them.
        self._instance = (int(time.time() * 1000), uuid.uuid4().hex)
        self._instance_tag = f"{self._instance[0]}:{self._instance[1]}".encode()
        self.router = Router(router_config, clock=clock)
        self.codec = AvroCodec()
        self.fold = LogFold(self.router, EventCodec(self.codec).decode, authority_from_settings(settings.fold))
        self.active_codec = ActiveOpCodec(self.codec)
        #: The workers' registrations (kvstream.workers), the gateway's WorkerDirectory.
        self.registry = WorkerRegistry(RegistrationCodec(self.codec))
        self._registry_next: dict[int, int] = {}
        self._registry_loaded = threading.Event()
        #: Who may win a /v1/route: registered workers (kvstream.replica.admission).
        self.admission = admission_from_settings(settings)
        self.metrics = ReplicaMetrics()
        self.lock = threading.RLock()
        self.events_topic = settings.topics.name("events")
        self.store: SnapshotStore | None = None
        self._store_note: str | None = None
        if self.options.snapshot_dir:
            self.store, self._store_note = open_store(Path(self.options.snapshot_dir))
        self.snapshotter: Snapshotter | None = None
        self._stop = threading.Event()
        o = self.options
        self.supervisor = Supervisor(
            self.replica_id, self._stop, self.metrics,
            RestartPolicy(o.thread_backoff_s, o.thread_max_backoff_s, o.thread_max_failures), on_fatal,
        )
        #: Partitions found by the metadata check, for the ingest thread to assign.
        self._new_partitions: list[int] = []
        self._last_metadata = time.monotonic()
        # Load ops must reach the peers at once; a replica's few records need no batching.
        self._producer = Producer(producer_config(settings, **{"client.id": self.replica_id, "linger.ms": 2}))
        self._lag: dict[int, int] = {}
        #: Wall-clock time since when the index has been known to be behind (lag past
        #: ready_max_lag) and since when the broker has not answered, or None.
        self._behind_since: float | None = None
        self._broker_down_since: float | None = None
        #: worker id → its engine issues, from the newest STATUS_HEADER seen.
        self._worker_status: dict[int, dict] = {}
        self._start_offsets: dict[int, int] = {}
        self._watermarks: Consumer | None = None
        self._ready = threading.Event()
        self._last_resync: dict[int | None, float] = {}
        #: Each partition's end offset when the replica started: resyncs the fold asks
        #: for below it are history, requested after catch-up only if still unhealed.
        self._history_end: dict[int, int] = {}
        #: worker id → (epoch the fold held when history asked for its resync, why).
        self._deferred_resync: dict[int, tuple[int, str]] = {}
        self._ticker = Ticker(self.replica_id, self.options.tick_interval_s, self._produce_tick, TickCodec(self.codec))
        self.topic_id: str | None = None
        self.partition_count = 0
        self.started_at = time.monotonic()
        self.ready_after_s: float | None = None
        self.recovery_notes: list[str] = []
        self._restored = None
        #: Client id → the peer replicas with an active request of that id.
        self._peer_owners: dict[str, set[str]] = {}
        #: Workers dropped at recovery → the epoch they had; ready waits for newer ones.
        self._awaiting_resync: dict[int, int] = {}
        self._awaiting_until = 0.0

    # -- lifecycle -------------------------------------------------------------------

    def start(self) -> None:
        """Recover (snapshot, offset checks, resync) and start the threads."""
        offsets = self._recover()
        self._start_offsets = offsets
        self.metrics.partitions.set(self.partition_count)
        if self.store is not None:
            self.snapshotter = Snapshotter(
                self.store, self.fold, self.events_topic, self.topic_id, self.partition_count,
                self.options.snapshot_every_records, self.options.snapshot_every_s, self.metrics,
                base=self._restored,
            )
        # Ingest and the lag/metadata check decide readiness: critical. Load sharing
        # degrades routing, not the index: retried for ever.
        self.supervisor.spawn("ingest", self._ingest_loop, critical=True)
        self.supervisor.spawn("lag", self._lag_loop, critical=True)
        self.supervisor.spawn("active", self._active_loop, critical=False)
        self.supervisor.spawn("workers", self._workers_loop, critical=False)

    def stop(self) -> None:
        """Stop the threads, finish the snapshot in progress, flush producers."""
        self._stop.set()
        # With the broker gone, nothing waits on it: the threads' last commits and the
        # producer's queue cannot land anyway (positions are only for Kafka's tooling;
        # the snapshot, taken locally, is what a restart resumes from).
        down = self._broker_down_since is not None
        for t in self.supervisor.threads:
            t.join(timeout=2 if down else 30)
        if self.snapshotter is not None and not self.snapshotter.close(final=True):
            log.error("stopped without a final snapshot: the next start replays more", replica=self.replica_id)
        unsent = self._producer.flush(0 if down else 10)
        if unsent:
            log.warning("stopped with records not delivered (DLQ, load, ticks)", replica=self.replica_id,
                        records=unsent, broker_unreachable=down)
        # Release the clients now: a stopped replica must not keep dialling the broker.
        self._producer = None  # type: ignore[assignment]
        if self._watermarks is not None:
            self._watermarks.close()
        if self.store is not None:
            self.store.close()

    @property
    def ready(self) -> bool:
        """Caught up once since start (the start-up gate) and healthy; a live replica
        behind the log stays ready unless ``refuse_when_stale``."""
        if not self._ready.is_set() or not self._registry_loaded.is_set() or self.supervisor.problems():
            return False
        return not (self.options.refuse_when_stale and self.staleness() is not None)

    def staleness(self) -> dict[str, object] | None:
        """Why a live replica's index is known to be behind, or None: lag past
        ``ready_max_lag`` (records, and since when) and/or the broker unreachable (since
        when). Each routing decision made meanwhile carries it."""
        out: dict[str, object] = {}
        if self._behind_since is not None:
            lagging = {str(p): n for p, n in self._lag.items() if n > self.options.ready_max_lag}
            out.update(lag_records=sum(lagging.values()), lagging_partitions=lagging,
                       behind_since=_iso(self._behind_since))
        if self._broker_down_since is not None:
            out["broker_unreachable_since"] = _iso(self._broker_down_since)
        return out or None

    def wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self._ready.wait(max(0.0, deadline - time.monotonic())):
            if self.ready:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return False

    @property
    def fatal(self) -> str | None:
        """Why the replica gave up (None while it runs)."""
        return self.supervisor.fatal

    def not_ready_reasons(self) -> list[str]:
        """Why ``/readyz`` says 503 (empty when ready)."""
        reasons = self.supervisor.problems()
        lagging = {p: n for p, n in self._lag.items() if n > self.options.ready_max_lag}
        if lagging and (not self._ready.is_set() or self.options.refuse_when_stale):
            reasons.append(f"catching up: lag {lagging} > {self.options.ready_max_lag} records")
        if self._broker_down_since is not None and self.options.refuse_when_stale:
            reasons.append(f"broker unreachable since {_iso(self._broker_down_since)}")
        if self._awaiting_resync:
            reasons.append(f"waiting for workers dropped at recovery to resync: {sorted(self._awaiting_resync)}")
        if not self._registry_loaded.is_set():
            reasons.append("reading the worker registry (kvstream.workers)")
        if not reasons and not self._ready.is_set():
            reasons.append("starting")
        return reasons

    # -- recovery --------------------------------------------------------------------

    def _recover(self) -> dict[int, int]:
        """Restore the newest valid snapshot, check its offsets against the broker, and
        return the offset to start each partition at."""
        admin = AdminClient(admin_config(self.settings))
        try:
            md = admin.list_topics(self.events_topic, timeout=CONNECT_TIMEOUT_S)
        except KafkaException as exc:
            raise RecoveryError(
                f"cannot reach Kafka at {admin_config(self.settings)['bootstrap.servers']} within "
                f"{CONNECT_TIMEOUT_S:.0f} s ({exc.args[0].str() if exc.args else exc}): is the broker up "
                "(`kvstream broker start`) and the bootstrap right (--bootstrap, KVSTREAM_BOOTSTRAP)?"
            ) from None
        tmd = md.topics.get(self.events_topic)
        if tmd is None or tmd.error is not None:
            raise RecoveryError(
                f"topic {self.events_topic} is missing (create it with `kvstream topics create`)"
            )
        self.partition_count = len(tmd.partitions)
        self.topic_id = topic_id(self.settings, self.events_topic)
        loaded = None
        if self._store_note is not None:
            self.metrics.snapshot_fallbacks.labels(skipped="store").inc()
            self._note(f"snapshot store unusable: {self._store_note}")
        if self.store is not None:
            if not self.store.candidates()[0] and self.options.peer_url:
                self._bootstrap_from_peer()
            loaded, skipped = self.store.load_latest()
            for reason in skipped:
                self.metrics.snapshot_fallbacks.labels(skipped="generation").inc()
                self._note(f"snapshot skipped: {reason}")
            if loaded is None and skipped:
                self.metrics.snapshot_fallbacks.labels(skipped="all").inc()
                self._note("no snapshot generation is usable: full replay")
            if loaded is not None and (foreign := self._foreign_snapshot(loaded[0])) is not None:
                self.metrics.snapshot_fallbacks.labels(skipped="foreign").inc()
                self._note(f"snapshot refused: {foreign}: full replay")
                loaded = None
        # Watermarks come from a consumer that never fetches: on the fetching one, each
        # query waits behind a long-poll fetch and stalls ingest.
        self._watermarks = Consumer(consumer_config(self.settings))
        bounds = self._bounds(timeout=30)
        offsets = {p: low for p, (low, _) in bounds.items()}
        self._history_end = {p: high for p, (_, high) in bounds.items()}
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

    def _foreign_snapshot(self, meta: SnapshotMeta) -> str | None:
        """Why a snapshot was written for another topic (None: it is this one's). The
        same name with another id is this topic recreated, which recovery handles."""
        if meta.topic != self.events_topic:
            return f"it was written for topic {meta.topic}, not {self.events_topic}"
        return None

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
            gen = fetch_peer_snapshot(
                self.options.peer_url, self.store, self.options.peer_token,
                max_bytes=self.options.peer_max_bytes, ca_file=self.options.peer_ca_file,
            )
            self._note(f"bootstrapped from peer {self.options.peer_url} (generation {gen})")
        except Exception as exc:  # any failure means: replay from the start instead
            self._note(f"peer bootstrap from {self.options.peer_url} failed: {exc}")

    def _note(self, text: str) -> None:
        self.recovery_notes.append(text)
        log.warning("recovery", replica=self.replica_id, note=text)

    # -- ingest ----------------------------------------------------------------------

    def _ingest_loop(self) -> None:
        """One run of ingest (the supervisor runs it again after a failure): a fresh
        consumer assigned where the fold stands, so nothing is read twice or skipped."""
        consumer = Consumer(
            consumer_config(self.settings, group_id=replica_group_id(self.replica_id),
                            on_commit=commit_callback(self._commit_failed))
        )
        self._positions = PositionCommitter(
            consumer, self.events_topic, self.options.commit_interval_s, self._commit_failed
        )
        try:
            with self.lock:
                at = self.positions()
                self._new_partitions.clear()  # assigned below with the others
            consumer.assign([
                TopicPartition(self.events_topic, p, at.get(p, OFFSET_BEGINNING)) for p in range(self.partition_count)
            ])
            while not self._stop.is_set():
                if self._new_partitions:
                    self._assign_new(consumer)
                # Wait for one record, then take what is already there: low lag when
                # quiet, large batches under load.
                msgs = consumer.consume(1, 0.05)
                if msgs:
                    msgs += consumer.consume(self.options.consume_batch - 1, 0)
                    fold_in_slices(self.lock, msgs, self._apply_messages, self.options.fold_slice)
                if self.snapshotter is not None:
                    with self.lock:
                        self.snapshotter.step()
                self._housekeeping()
                self.supervisor.progress("ingest")
        finally:
            if self._broker_down_since is None:
                self._positions.final(self.positions())
            consumer.close()

    def _assign_new(self, consumer: Consumer) -> None:
        with self.lock:
            new, self._new_partitions = self._new_partitions, []
        # From their start: a new partition holds only records written since it was added.
        consumer.incremental_assign([TopicPartition(self.events_topic, p, OFFSET_BEGINNING) for p in new])
        log.info("partitions added", replica=self.replica_id, partitions=new)

    def positions(self) -> dict[int, int]:
        """Next offset to read per partition: where the fold is, else where reading
        started (a partition with nothing new since the snapshot)."""
        with self.lock:
            return {**self._start_offsets, **self.fold.next_offsets()}

    def _commit_failed(self, error: str) -> None:
        self.metrics.commit_failures.inc()
        log.warning("position commit failed", replica=self.replica_id, error=error)

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
            record = read_record(m)
            if record.status is not None:
                self._note_worker_status(record)
            out = fold.apply(record)
            m_applied += out.applied_events
            if out.dlq_reason is not None:
                self._to_dlq(m, out.dlq_reason, by_reference=record.problem is not None)
            for wid in out.resync:
                self._fold_resync(m.partition(), m.offset(), wid, out.dlq_reason)
        self.metrics.events_applied.inc(m_applied)
        self.metrics.records.inc(records)
        if self.snapshotter is not None and records:
            self.snapshotter.records_applied(records)

    def _to_dlq(self, m, reason: str, by_reference: bool = False) -> None:
        """Copy a record to the DLQ with the reason; one larger than ``dlq_max_bytes``,
        or whose headers could not be read (``by_reference``), is referenced instead
        (where it is, its size and SHA-256), so that the copy can never be refused."""
        self.metrics.dlq.inc()
        value, key = m.value(), m.key()
        source = f"{m.topic()}/{m.partition()}/{m.offset()}"
        try:
            headers = list(m.headers() or [])
        except Exception:  # noqa: BLE001 - unreadable headers: reference the record
            headers, by_reference = [], True
        size = len(value or b"") + len(key or b"") + sum(len(k) + len(v or b"") for k, v in headers)
        if by_reference or size > self.options.dlq_max_bytes:
            digest = hashlib.sha256(value or b"").hexdigest()
            self.metrics.dlq_referenced.inc()
            value = json.dumps({
                "topic": m.topic(), "partition": m.partition(), "offset": m.offset(),
                "size": size, "sha256": digest, "reason": reason[:2000],
            }).encode()
            headers = [(_REF_HEADER, f"size={size} sha256={digest}".encode())]
            key = key if key is not None and len(key) <= 1024 else None
        headers += [(_ERROR_HEADER, reason[:2000].encode()), (_SOURCE_HEADER, source.encode())]
        self._produce("dlq", self.settings.topics.name("dlq"), value=value, key=key, headers=headers)

    def _produce(self, what: str, topic: str, poll: bool = True, **kw) -> None:
        """Produce without ever raising: a record the producer refuses at once (too
        large, queue full, ...) is counted and logged; the caller goes on. ``poll``:
        serve delivery reports now, else at the ingest loop's next housekeeping (at
        most 50 ms away)."""
        try:
            self._producer.produce(topic, on_delivery=self._delivery, **kw)
        except Exception as exc:  # noqa: BLE001 - never raise: e.g. a header the client refuses
            error = exc.args[0].name() if isinstance(exc, KafkaException) and isinstance(exc.args[0], KafkaError) else type(exc).__name__
            self.metrics.produce_refused.labels(what=what, error=error).inc()
            log.error("produce refused", what=what, topic=topic, error=str(exc))
        if poll:
            self._producer.poll(0)

    def _delivery(self, err, _msg) -> None:
        if err is not None:
            self.metrics.produce_failures.inc()
            log.error("produce failed", error=str(err))

    def _fold_resync(self, partition: int, offset: int, wid: int, why: str | None) -> None:
        """The fold asks ``wid`` to resync (a gap, an id conflict, a stale or moved
        epoch). Read from the log's history (before the end the replica started at), it
        may have healed long ago: deferred until the replica has caught up, and sent
        only if the worker has started no newer epoch since (:meth:`_flush_deferred`)."""
        held = self.fold.workers.get(wid)
        reason = (why or "event id gap or epoch without cleared").split(";")[0]
        if offset + 1 < self._history_end.get(partition, 0):
            if held is not None:
                self._deferred_resync[wid] = (held.epoch, reason)
            return
        self._request_resync(wid, reason, None if held is None else held.epoch)

    def _flush_deferred(self) -> None:
        """Once caught up with the end the replica started at: request the resyncs that
        history asked for and the log has not healed (the worker is still at the epoch
        it had then); drop the rest."""
        if not self._deferred_resync:
            return
        at = self.positions()
        if any(at.get(p, 0) < end for p, end in self._history_end.items()):
            return
        with self.lock:
            deferred, self._deferred_resync = self._deferred_resync, {}
            for wid, (epoch, reason) in deferred.items():
                held = self.fold.workers.get(wid)
                if held is not None and held.epoch <= epoch:
                    self._request_resync(wid, f"{reason} (still unhealed on the log)", held.epoch)
                else:
                    self.metrics.resyncs_healed.inc()

    def _request_resync(self, worker_id: int | None, reason: str, above_epoch: int | None = None) -> None:
        now = time.monotonic()
        last = self._last_resync.get(worker_id)
        if last is not None and now - last < self.options.resync_min_interval_s:
            return
        self._last_resync[worker_id] = now
        self.metrics.resync_requests.inc()
        wid = None if worker_id is None else (worker_id - (1 << 64) if worker_id >= 1 << 63 else worker_id)
        value = self.codec.encode(
            RESYNC_REQUEST,
            {"worker_id": wid, "requester": self.replica_id, "reason": reason[:500],
             "requested_at_ms": int(time.time() * 1000),
             "above_epoch": None if above_epoch is None else (above_epoch - (1 << 64) if above_epoch >= 1 << 63 else above_epoch)},
        )
        self._produce("resync", self.settings.topics.name("control"), value=value)

    def _housekeeping(self) -> None:
        self._flush_deferred()
        with self.lock:
            self._ticker.step(self.fold)
        self._positions.step(self.positions)
        self._producer.poll(0)

    def _produce_tick(self, partition: int, key: bytes, value: bytes, headers: list[tuple[str, bytes]]) -> None:
        self.metrics.ticks.inc()
        self._produce("tick", self.events_topic, value=value, key=key, partition=partition, headers=headers)

    def _lag_loop(self) -> None:
        # Its own thread: a slow broker answer must never stall ingest.
        while not self._stop.is_set():
            if time.monotonic() - self._last_metadata >= self.options.metadata_interval_s:
                self._check_partitions()
            self._update_lag()
            self.supervisor.progress("lag")
            self._stop.wait(0.5)

    def _check_partitions(self) -> None:
        """Find partitions added to the events topic since the last check."""
        self._last_metadata = time.monotonic()
        try:
            md = self._watermarks.list_topics(self.events_topic, timeout=10).topics.get(self.events_topic)
        except KafkaException as exc:
            log.warning("metadata check failed", error=str(exc))
            return
        if md is None or md.error is not None:
            return
        count = len(md.partitions)
        if count <= self.partition_count:
            return
        with self.lock:
            added = list(range(self.partition_count, count))
            self._new_partitions.extend(added)
            self.partition_count = count
            if self.snapshotter is not None:
                self.snapshotter.partition_count = count
        self.metrics.partitions.set(count)
        log.warning("events topic has new partitions", replica=self.replica_id, added=added, partitions=count)

    def _update_lag(self) -> None:
        offsets = self.positions()
        try:
            bounds = self._bounds(timeout=0)
        except RecoveryError as exc:
            # Leases run in log time, so nothing expires while no record arrives: say
            # that the index is frozen rather than report a lag of 0.
            if self._broker_down_since is None:
                self._broker_down_since = time.time()
                self.metrics.broker_unreachable.set(1)
                log.error("broker unreachable: routing goes on with the index as it stands, marked stale",
                          replica=self.replica_id, error=str(exc))
            self._mark_stale()
            return
        if self._broker_down_since is not None:
            log.warning("broker reachable again", replica=self.replica_id,
                        after_s=round(time.time() - self._broker_down_since, 1))
            self._broker_down_since = None
            self.metrics.broker_unreachable.set(0)
        lag = {}
        for p, (_, high) in bounds.items():
            lag[p] = max(0, high - offsets.get(p, 0))
            self.metrics.lag.labels(partition=str(p)).set(lag[p])
        self._lag = lag
        caught_up = all(v <= self.options.ready_max_lag for v in lag.values())
        if not self._ready.is_set():
            # The start-up gate: a replica's index is not the fleet's until it has caught up.
            if caught_up and not self._resyncs_pending():
                self.ready_after_s = time.monotonic() - self.started_at
                log.info("ready", replica=self.replica_id, after_s=round(self.ready_after_s, 3))
                self._ready.set()
            return
        if caught_up:
            if self._behind_since is not None:
                log.info("caught up again", replica=self.replica_id,
                         after_s=round(time.time() - self._behind_since, 1))
            self._behind_since = None
        elif self._behind_since is None:
            self._behind_since = time.time()
            log.warning("behind the log: routing goes on, decisions marked stale", replica=self.replica_id,
                        lag=sum(lag.values()), ready_max_lag=self.options.ready_max_lag)
        self._mark_stale()

    def _mark_stale(self) -> None:
        self.metrics.stale.set(0 if self.staleness() is None else 1)

    def lag(self) -> dict[int, int]:
        return dict(self._lag)

    def _note_worker_status(self, record: Record) -> None:
        """A worker's engine issues (STATUS_HEADER), shown by /v1/workers."""
        if record.key is not None and len(record.key) == 8:
            self._worker_status[int.from_bytes(record.key, "big")] = dict(record.status or {})

    def workers_view(self) -> dict[str, object]:
        """Per worker: blocks per rank and tier, epoch, last event ids, partition lag."""
        with self.lock:
            sizes = self.router.tree_sizes()
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
            for wid, reg in self.registry.registrations().items():
                out.setdefault(str(wid), {"ranks": {}})["registration"] = reg.view()
            for wid, clash in self.fold.clashes.items():
                # Two processes publishing as this worker id (kvstream.replica.fold.Clash).
                out.setdefault(str(wid), {"ranks": {}})["clash"] = clash.view()
        return {"replica_id": self.replica_id, "ready": self.ready, "stale": self.staleness(), "workers": out}

    # -- worker registry -------------------------------------------------------------

    def registry_positions(self) -> dict[int, int]:
        """Per partition of kvstream.workers, the next offset the registry folds."""
        return dict(self._registry_next)

    def _workers_loop(self) -> None:
        """Fold ``kvstream.workers`` into :attr:`registry`: the whole compacted topic from
        its start, then what follows. A restarted loop resumes where the last one left."""
        topic = self.settings.topics.name("workers")
        consumer = Consumer(consumer_config(self.settings))
        try:
            while not self._stop.is_set():
                md = consumer.list_topics(topic, timeout=30).topics.get(topic)
                if md is not None and md.error is None and md.partitions:
                    break
                # Not ready-blocking: /v1/route works without it; the gateway has no workers.
                self._registry_loaded.set()
                log.error("worker registry topic missing; create it with `kvstream topics create`", topic=topic)
                self._stop.wait(10)
            else:
                return
            parts = sorted(md.partitions)
            ends = {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=30)[1] for p in parts}
            consumer.assign([TopicPartition(topic, p, self._registry_next.get(p, OFFSET_BEGINNING)) for p in parts])
            while not self._stop.is_set():
                for m in consumer.consume(500, 0.1):
                    if m.error() is not None:
                        if m.error().code() != KafkaError._PARTITION_EOF:
                            self.metrics.consume_errors.inc()
                        continue
                    self._apply_registration(m)
                    self._registry_next[m.partition()] = m.offset() + 1
                if not self._registry_loaded.is_set() and all(
                    self._registry_next.get(p, 0) >= end or consumer.position([TopicPartition(topic, p)])[0].offset >= end
                    for p, end in ends.items()
                ):
                    self._registry_loaded.set()
                    log.info("worker registry loaded", replica=self.replica_id,
                             workers=len(self.registry.registrations()))
                self.supervisor.progress("workers")
        finally:
            consumer.close()

    def _apply_registration(self, m) -> None:
        """One record of the workers topic; a bad one is counted and skipped."""
        reason = self.registry.apply(m.key(), m.value())
        if reason is None:
            self.metrics.registry_records.inc()
            self.metrics.registered_workers.set(len(self.registry.registrations()))
            return
        self.metrics.registry_skipped.labels(reason=reason).inc()
        if reason != "unknown_tombstone":
            log.warning("worker registration skipped", reason=reason, partition=m.partition(), offset=m.offset())

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
                    self._apply_peer_op(m.value(), m.headers(), m.timestamp()[1])
        finally:
            consumer.close()

    def _apply_peer_op(self, value: bytes | None, headers: list | None = None, timestamp_ms: int = 0) -> None:
        try:
            if value is None:
                raise DecodeError("active op record has no value")
            owner, op = self.active_codec.decode(value)
        except DecodeError as exc:
            self.metrics.active_errors.labels(reason="undecodable").inc()
            log.warning("bad active op", error=str(exc))
            return
        # The op's sender: its owner, or the replica that took it on the owner's behalf.
        sender = next((v.decode(errors="replace") for k, v in headers or () if k == _SENDER_HEADER), owner)
        if sender == self.replica_id:
            self._own_id_op(headers, timestamp_ms)  # ours (applied when made), or a clash
            return
        with self.lock:
            try:
                self.router.apply_active(op)
                self.metrics.active_ops.labels(source="peer").inc()
            except RouterError as exc:  # e.g. free of a request that already expired here
                self.metrics.active_errors.labels(reason=type(exc).__name__).inc()
                return
            if owner != self.replica_id:
                self._note_peer_request(owner, op)

    def _own_id_op(self, headers: list | None, timestamp_ms: int) -> None:
        """A load op under this replica's id: ours, an earlier incarnation's (before this
        one started), or another replica's given the same id, which would silently stop
        the two sharing load. Of two such instances the one that started later gives up
        (``kvstream router`` exits non-zero with the reason); the other counts it."""
        tag = dict(headers or ()).get(_INSTANCE_HEADER)
        if tag == self._instance_tag or timestamp_ms < self._instance[0] or self.supervisor.fatal is not None:
            return
        self.metrics.replica_id_conflicts.inc()
        start, _, nonce = (tag or b"0:").decode(errors="replace").partition(":")
        other = (int(start) if start.isdigit() else 0, nonce)
        reason = (f"another running replica uses replica_id {self.replica_id!r} (instance {other[0]}:{other[1]}): "
                  "every replica needs its own")
        if other < self._instance:
            self.supervisor.give_up(reason)
        else:
            log.error("replica id conflict: the other instance started later and gives up", reason=reason)

    def _note_peer_request(self, owner: str, op: ActiveOp) -> None:
        """Which replica owns each client id of the peers' active requests (for a
        prefill_done or free that reaches this replica instead of the owner)."""
        client_id = unscoped(op.request_id)
        if isinstance(op, AddRequest):
            self._peer_owners.setdefault(client_id, set()).add(owner)
            if len(self._peer_owners) > 2 * self.router.active_requests() + 1024:  # expired ones
                self._peer_owners = {
                    c: live for c, owners in self._peer_owners.items()
                    if (live := {o for o in owners if self.router.is_active(scoped(o, c))})
                }
        elif isinstance(op, FreeRequest):
            owners = self._peer_owners.get(client_id)
            if owners is not None:
                owners.discard(owner)
                if not owners:
                    del self._peer_owners[client_id]

    def share(self, op: ActiveOp, owner: str | None = None) -> None:
        """Publish a load op on kvstream.active for the peer replicas; ``owner``: the
        replica whose request it is, when this one takes it on its behalf."""
        self.metrics.active_ops.labels(source="local").inc()
        headers = [(_INSTANCE_HEADER, self._instance_tag)]
        if owner is not None:
            headers.append((_SENDER_HEADER, self.replica_id.encode()))
        # Three ops per relayed request: a poll after each would cost as much as the op.
        self._produce(
            "active", self.settings.topics.name("active"), poll=False,
            value=self.active_codec.encode(owner or self.replica_id, op), key=op.request_id.encode(),
            headers=headers,
        )

    # -- requests --------------------------------------------------------------------

    def route(
        self,
        token_ids: PromptTokens,
        lora_name: str | None = None,
        request_id: str | None = None,
        query_only: bool = False,
        overrides: SchedulerOverrides | None = None,
        *,
        cache_salt: str | None = None,
        mm: Sequence[MmSpan] = (),
        candidates: Sequence[WorkerKey] | None = None,
        share: bool = True,
    ) -> RouteDecision:
        """Route a prompt (Router.find_best_match: ``candidates`` limits who competes;
        None: the admitted workers, kvstream.replica.admission) and share the load it
        adds; with ``share=False`` the caller shares ``decision.op`` itself
        (:meth:`share`), e.g. once its request has left."""
        # Tracked under this replica's scope (kvstream.replica.request_ids): a peer's
        # request with the same client id is another request.
        key = None if request_id is None else scoped(self.replica_id, request_id)
        with self.lock:
            if candidates is None:
                candidates = self.admission.candidates(self.router, self.registry.worker_ids())
            decision = self.router.find_best_match(
                token_ids, lora_name, key, query_only, overrides, cache_salt=cache_salt, mm=mm,
                candidates=candidates,
            )
        if share and decision.op is not None:
            self.share(decision.op)
        return replace(decision, request_id=request_id)

    def prefill_done(self, request_id: str) -> None:
        """The request's first token; a request another replica routed (a load-balanced
        client) is marked on that replica's behalf."""
        self._request_op(self.router.prefill_done, request_id)

    def free(self, request_id: str) -> None:
        """The request ended; as prefill_done, for this replica's requests or a peer's."""
        self._request_op(self.router.free, request_id)

    def _request_op(self, apply: Callable[[str], ActiveOp], request_id: str) -> None:
        owner = None
        with self.lock:
            try:
                op = apply(scoped(self.replica_id, request_id))
            except UnknownRequestError:
                owners = self._peer_owners.get(request_id, set())
                if len(owners) != 1:
                    if owners:
                        raise AmbiguousRequestError(
                            f"request {request_id!r} is active on several other replicas ({', '.join(sorted(owners))}): "
                            "send it to the replica that routed it"
                        ) from None
                    raise
                (owner,) = owners
                op = apply(scoped(owner, request_id))
                if isinstance(op, FreeRequest):
                    self._note_peer_request(owner, op)
        self.share(op, owner)


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="milliseconds")

