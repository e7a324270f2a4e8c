"""A router replica: the Kafka side of the fold (DESIGN.md §6, §7), as one facade.

:meth:`Replica.start` recovers (kvstream.replica.recovery: the snapshot, its offsets
checked against the broker, resyncs for what it cannot vouch for) and starts the
threads: ingest (kvstream.replica.ingest: the events topic folded under the router
lock; DLQ copies, resync requests and log-clock ticks produced after the lock is
released), lag (kvstream.replica.lag: readiness, staleness, partitions added while the
replica runs), load sharing (kvstream.replica.load, through ``kvstream.active``) and
the worker registry (kvstream.replica.registry_reader). The HTTP service
(kvstream.replica.service) calls ``route`` / ``prefill_done`` / ``free``.

Every thread runs under a :class:`~kvstream.replica.supervisor.Supervisor`: a failure is
logged, counted, shown on ``/readyz`` and retried with backoff; one that keeps failing
makes the replica give up (``kvstream router`` exits non-zero). No record can stop
ingest: the fold dead-letters what it cannot apply, a DLQ copy is bounded
(kvstream.replica.dlq), and a refused produce is counted and logged, never raised
(kvstream.kafka.producer).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path

from confluent_kafka import Consumer

from kvstream.events.codec import AvroCodec, EventCodec
from kvstream.events.registration import RegistrationCodec
from kvstream.hashing import MmSpan
from kvstream.kafka.config import consumer_config, producer_config
from kvstream.kafka.producer import CountingProducer
from kvstream.logs import get_logger
from kvstream.replica.active_codec import ActiveOpCodec
from kvstream.replica.admission import admission_from_settings
from kvstream.replica.authority import authority_from_settings
from kvstream.replica.fold import LogFold
from kvstream.replica.ingest import Ingest, Partitions
from kvstream.replica.lag import LagWatch, iso
from kvstream.replica.load import LoadSharing
from kvstream.replica.loop_lock import LoopLock
from kvstream.replica.metrics import ReplicaMetrics
from kvstream.replica.modes import Routable, WorkerModes
from kvstream.replica.options import ReplicaOptions
from kvstream.replica.recovery import PeerSource, recover
from kvstream.replica.registry import WorkerRegistry
from kvstream.replica.registry_reader import RegistryReader
from kvstream.replica.request_ids import scoped
from kvstream.replica.resync import AwaitedResyncs, ResyncRequester
from kvstream.replica.snapshot import SnapshotStore, open_store
from kvstream.replica.snapshotter import Snapshotter
from kvstream.replica.supervisor import RestartPolicy, Supervisor
from kvstream.router import Router, RouterConfig
from kvstream.router.active import ActiveOp
from kvstream.router.core import PromptTokens
from kvstream.router.index import WorkerKey
from kvstream.router.router import RouteDecision
from kvstream.router.scheduler import SchedulerOverrides
from kvstream.settings import Settings

log = get_logger(__name__)


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
        self.options = o = options or ReplicaOptions()
        self.replica_id = o.replica_id
        self.router = Router(router_config, clock=clock)
        self.codec = AvroCodec()
        self.fold = LogFold(self.router, EventCodec(self.codec), authority_from_settings(settings.fold))
        self.active_codec = ActiveOpCodec(self.codec)
        #: The workers' registrations (kvstream.workers): admission reads them, and the
        #: gateway's directory of registered workers (kvstream.gateway.static).
        self.registry = WorkerRegistry(RegistrationCodec(self.codec))
        #: Who may win a /v1/route: registered workers (kvstream.replica.admission).
        self.admission = admission_from_settings(settings)
        self.metrics = ReplicaMetrics()
        self.lock = threading.RLock()
        #: The lock as the event loop takes it (the gateway, POST /v1/route).
        self.loop_lock = LoopLock(self.lock)
        self.events_topic = settings.topics.name("events")
        self.store: SnapshotStore | None = None
        self._store_note: str | None = None
        if o.snapshot_dir:
            self.store, self._store_note = open_store(Path(o.snapshot_dir))
        self.snapshotter: Snapshotter | None = None
        self._stop = threading.Event()
        self.supervisor = Supervisor(
            self.replica_id, self._stop, self.metrics,
            RestartPolicy(o.thread_backoff_s, o.thread_max_backoff_s, o.thread_max_failures), on_fatal,
        )
        # The producers' linger (10 ms unless kafka_options says otherwise) is the load
        # ops' pacing window (kvstream.replica.pacer: sparse ones at once, dense ones a
        # window's worth together); the producer itself lingers only long enough to put
        # one window's ops in one produce request.
        config = producer_config(settings, **{"client.id": self.replica_id})
        share_window_s = float(config["linger.ms"]) / 1000
        self._producer = CountingProducer(
            {**config, "linger.ms": 1},
            on_refused=lambda what, error: self.metrics.produce_refused.labels(what=what, error=error).inc(),
            on_failed=lambda _what, _error: self.metrics.produce_failures.inc(),
        )
        self._resync = ResyncRequester(self.replica_id, self._producer, settings.topics.name("control"),
                                       o.resync_min_interval_s, self.metrics, self.codec)
        self._awaited = AwaitedResyncs(o.resync_wait_s, self._note)
        self._load = LoadSharing(settings, self.replica_id, self.router, self.lock, self.active_codec,
                                 self._producer, share_window_s, self.metrics, self.supervisor, self._stop)
        self._registry_reader = RegistryReader(settings, self.replica_id, self.registry, self.metrics, self._stop,
                                               partial(self.supervisor.progress, "workers"))
        #: How each routable worker is routed (by its events or approximately), stepped
        #: by a thread of its own.
        self.modes = WorkerModes(self.router, self._routable, self.fold.workers.keys, self.metrics.worker_mode,
                                 self.metrics.worker_role, clock)
        self._routable_of: tuple[object, dict[int, Routable]] = (None, {})
        #: worker id → its engine issues, from the newest STATUS_HEADER seen.
        self._worker_status: dict[int, dict] = {}
        self._partitions = Partitions(0)
        self._start_offsets: dict[int, int] = {}
        #: Asks for watermarks only (kvstream.replica.lag); made at start.
        self._offsets_consumer: Consumer | None = None
        self._watch: LagWatch | None = None
        self._ready = threading.Event()
        self.topic_id: str | None = None
        self.started_at = time.monotonic()
        self.recovery_notes: list[str] = []

    # -- lifecycle -------------------------------------------------------------------

    @property
    def partition_count(self) -> int:
        return self._partitions.count

    def start(self) -> None:
        """Recover (snapshot, offset checks, resync) and start the threads."""
        o = self.options
        # The registry (another topic, needed for ready) loads while recovery restores
        # the snapshot: in a restart from a snapshot, the two were a third each of the
        # time to ready, one after the other.
        self.supervisor.spawn("workers", self._registry_reader.run, critical=False)
        # Watermarks come from a consumer that never fetches: on the fetching one, each
        # query waits behind a long-poll fetch and stalls ingest.
        self._offsets_consumer = Consumer(consumer_config(self.settings))
        peer = None if not o.peer_url else PeerSource(o.peer_url, o.peer_token, o.peer_max_bytes, o.peer_ca_file)
        try:
            got = recover(self.settings, self.events_topic, self.fold, self.store, self._offsets_consumer,
                          self.metrics, self._note, store_note=self._store_note, peer=peer)
        except BaseException:
            # A replica that could not start must not keep dialling the broker.
            self._stop.set()  # the registry reader
            self._offsets_consumer.close()
            self._offsets_consumer = None
            raise
        self.topic_id = got.topic_id
        self._partitions = Partitions(got.partition_count)
        self._start_offsets = got.offsets
        self._resync.history_end = got.history_end
        for resync in got.resyncs:
            self._resync.request(resync)
        if got.dropped:
            self._awaited.add(got.dropped)
        self.metrics.partitions.set(got.partition_count)
        if self.store is not None:
            self.snapshotter = Snapshotter(
                self.store, self.fold, self.events_topic, self.topic_id, got.partition_count,
                o.snapshot_every_records, o.snapshot_every_s, self.metrics, base=got.restored,
            )
        ingest = Ingest(
            self.replica_id, self.settings, self.lock, self.fold, self._partitions, self.positions, self._producer,
            self._resync, self.metrics, self._stop, partial(self.supervisor.progress, "ingest"), self._broker_down,
            snapshotter=self.snapshotter, worker_status=self._worker_status, codec=self.codec,
            consume_batch=o.consume_batch, tick_interval_s=o.tick_interval_s,
            commit_interval_s=o.commit_interval_s, dlq_max_bytes=o.dlq_max_bytes,
        )
        self._watch = LagWatch(
            self.replica_id, self.events_topic, self._offsets_consumer, self.lock, self.fold, self._partitions,
            self.positions, self._awaited, self._ready, self.metrics, self._stop,
            partial(self.supervisor.progress, "lag"), snapshotter=self.snapshotter, ready_max_lag=o.ready_max_lag,
            metadata_interval_s=o.metadata_interval_s, started_at=self.started_at,
        )
        # Ingest and the lag/metadata check decide readiness: critical. Load sharing
        # degrades routing, not the index: retried for ever.
        self.supervisor.spawn("ingest", ingest.run, critical=True)
        self.supervisor.spawn("lag", self._watch.run, critical=True)
        self.supervisor.spawn("active", self._load.run, critical=False)
        self.supervisor.spawn("modes", self._step_modes, critical=False)

    def stop(self) -> None:
        """Stop the threads, finish the snapshot in progress, flush producers."""
        self._stop.set()
        # With the broker gone, nothing waits on it: the threads' last commits and the
        # producer's queue cannot land anyway (positions are only for Kafka's tooling;
        # the snapshot, taken locally, is what a restart resumes from).
        down = self._broker_down()
        for t in self.supervisor.threads:
            t.join(timeout=2 if down else 30)
        self._load.close()
        if self.snapshotter is not None and not self.snapshotter.close(final=True):
            log.error("stopped without a final snapshot: the next start replays more", replica=self.replica_id)
        unsent = self._producer.flush(0 if down else 10)
        if unsent:
            log.warning("stopped with records not delivered (DLQ, load, ticks)", replica=self.replica_id,
                        records=unsent, broker_unreachable=down)
        # Release the clients now: a stopped replica must not keep dialling the broker.
        self._producer.close()
        if self._offsets_consumer is not None:
            self._offsets_consumer.close()
        if self.store is not None:
            self.store.close()

    def _step_modes(self) -> None:
        while not self._stop.wait(self.options.modes_interval_s):
            with self.lock:
                self.modes.step()
            self.supervisor.progress("modes")

    def _routable(self) -> dict[int, Routable]:
        """The workers the gateway may route to: registered with an engine URL, and the
        static ones (the same object while the registry is unchanged)."""
        regs = self.registry.registrations()
        if regs is not self._routable_of[0]:
            out = {
                wid: Routable(r.dp_ranks, r.kv_capacity_blocks, r.role) for wid, r in regs.items() if r.url is not None
            }
            for w in self.settings.gateway.workers:
                out[w.id] = Routable(tuple(range(w.dp_ranks)), w.kv_capacity_blocks, w.role)
            self._routable_of = (regs, out)
        return self._routable_of[1]

    def _broker_down(self) -> bool:
        return self._watch is not None and self._watch.broker_down_since is not None

    @property
    def ready(self) -> bool:
        """Caught up once since start (the start-up gate) and healthy; a live replica
        behind the log stays ready unless ``refuse_when_stale``."""
        if not self._ready.is_set() or not self._registry_reader.loaded.is_set() or self.supervisor.problems():
            return False
        return not (self.options.refuse_when_stale and self.staleness() is not None)

    def staleness(self) -> dict[str, object] | None:
        """Why a live replica's index is known to be behind, or None: lag past
        ``ready_max_lag`` (records, and since when) and/or the broker unreachable (since
        when). Each routing decision made meanwhile carries it."""
        return None if self._watch is None else self._watch.staleness()

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
        lagging = {} if self._watch is None else self._watch.lagging()
        if lagging and (not self._ready.is_set() or self.options.refuse_when_stale):
            reasons.append(f"catching up: lag {lagging} > {self.options.ready_max_lag} records")
        down_since = None if self._watch is None else self._watch.broker_down_since
        if down_since is not None and self.options.refuse_when_stale:
            reasons.append(f"broker unreachable since {iso(down_since)}")
        if awaited := self._awaited.workers():
            reasons.append(f"waiting for workers dropped at recovery to resync: {awaited}")
        if not self._registry_reader.loaded.is_set():
            reasons.append("reading the worker registry (kvstream.workers)")
        if not reasons and not self._ready.is_set():
            reasons.append("starting")
        return reasons

    def _note(self, text: str) -> None:
        self.recovery_notes.append(text)
        log.warning("recovery", replica=self.replica_id, note=text)

    # -- where the fold stands -------------------------------------------------------

    def positions(self) -> dict[int, int]:
        """Next offset to read per partition: where the fold is, else where reading
        started (a partition with nothing new since the snapshot)."""
        with self.lock:
            return {**self._start_offsets, **self.fold.next_offsets()}

    def lag(self) -> dict[int, int]:
        return {} if self._watch is None else dict(self._watch.lag)

    def workers_view(self) -> dict[str, object]:
        """Per worker: blocks per rank and tier, epoch, last event ids, partition lag."""
        lag = self.lag()
        with self.lock:
            self.modes.step()
            sizes = self.router.tree_sizes()
            out: dict[str, dict] = {}
            for key, tiers in sizes.items():
                w = out.setdefault(str(key.worker_id), {"ranks": {}})
                w["ranks"][str(key.dp_rank)] = {t.value: n for t, n in tiers.items()}
            for key, n in self.router.expected_blocks().items():
                # Routed there, not confirmed by its events yet (the ranks' tiers are the index's).
                w = out.setdefault(str(key.worker_id), {"ranks": {}})
                w.setdefault("expected_blocks", {})[str(key.dp_rank)] = n
            for wid, mode in self.modes.modes.items():
                out.setdefault(str(wid), {"ranks": {}})["mode"] = mode
            for wid, w in self._routable().items():
                out.setdefault(str(wid), {"ranks": {}})["role"] = str(w.role)
            for wid, wlog in self.fold.workers.items():
                w = out.setdefault(str(wid), {"ranks": {}})
                w.update(
                    epoch=wlog.epoch,
                    last_event_ids={str(r): i for r, i in wlog.last_ids.items()},
                    partition=wlog.partition,
                    lag=lag.get(wlog.partition),
                    last_seen_ms=wlog.last_seen_ms,
                    engine_issues=self._worker_status.get(wid, {}),
                )
            for wid, reg in self.registry.registrations().items():
                out.setdefault(str(wid), {"ranks": {}})["registration"] = reg.view()
            for wid, clash in self.fold.clashes.items():
                # Two processes publishing as this worker id (kvstream.replica.fold.Clash).
                out.setdefault(str(wid), {"ranks": {}})["clash"] = clash.view()
        return {"replica_id": self.replica_id, "ready": self.ready, "stale": self.staleness(), "workers": out}

    # -- requests --------------------------------------------------------------------

    def share(self, op: ActiveOp, owner: str | None = None) -> None:
        """Publish a load op on kvstream.active for the peer replicas; ``owner``: the
        replica whose request it is, when this one takes it on its behalf."""
        self._load.share(op, owner)

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
        self._load.request_op(self.router.prefill_done, request_id)

    def free(self, request_id: str, refuted: bool = False) -> None:
        """The request ended (``refuted``: before its prompt was computed, so the blocks
        it predicted on its worker are no longer expected there); as prefill_done, for
        this replica's requests or a peer's."""
        self._load.request_op(partial(self.router.free, refuted=refuted), request_id)
