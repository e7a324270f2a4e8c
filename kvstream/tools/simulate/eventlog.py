"""Event logs between the simulated workers and the router: in memory, or Kafka.

Both carry the same records: every worker's router events, encoded as
:class:`~kvstream.events.model.EventBatch` records by :class:`EventCodec`, on partition
``worker_id mod partitions``, folded into a Router by :class:`LogFold` exactly as a
replica folds ``kvstream.events``. :meth:`EventLog.sync` makes visibility deterministic:
it publishes everything written so far and returns once the fold has applied all of it,
so that a routing decision sees exactly the events emitted before it in simulated time,
whichever log carries them.
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Protocol

from confluent_kafka import Consumer, KafkaException

from kvstream.events.codec import EventCodec
from kvstream.events.model import EventBatch
from kvstream.kafka.config import consumer_config
from kvstream.kafka.metadata import end_offsets, topic_partitions
from kvstream.replica.fold import LogFold
from kvstream.replica.replica import Replica, ReplicaOptions
from kvstream.router import Router, RouterConfig
from kvstream.settings import Settings
from kvstream.tools.simulate.errors import EventLogError
from kvstream.worker.batcher import EventBatcher
from kvstream.worker.consolidator import RouterEventWriter
from kvstream.worker.publisher import KafkaPublisher, PublisherOptions

#: Workers are never expired during a simulation: its log time is simulated time (in
#: memory) or wall time (Kafka), and either may leave a worker silent for long.
SIM_LEASE_MS = 7 * 24 * 3600 * 1000


@dataclass(frozen=True, slots=True)
class LogStats:
    records: int
    events: int
    #: Non-zero counters of the fold and of the router's index (rejected or skipped
    #: events: a sound simulation has none).
    counters: dict[str, int]


def _counters(fold: LogFold) -> dict[str, int]:
    return {k: v for k, v in sorted(fold.rejections().items()) if v}


class EventLog(Protocol):
    """Where simulated workers write router events and the router reads them."""

    def writer(self, worker_id: int) -> RouterEventWriter:
        """A writer for one worker (its first record is its ``cleared``)."""
        ...

    def sync(self, now_ms: int) -> None:
        """Publish what was written (timestamped ``now_ms`` where the log lets us) and
        wait until the router has applied it all."""
        ...

    def routing(self) -> AbstractContextManager[Router]:
        """The router, held for one routing step (no event is applied meanwhile)."""
        ...

    def stats(self) -> LogStats: ...

    def agree(self) -> bool:
        """Every replica folded the same index (trivially true with one)."""
        ...

    def close(self) -> None: ...


class MemoryEventLog:
    """A partitioned log in memory (lists of encoded records), folded by one LogFold."""

    def __init__(self, router_config: RouterConfig, clock: Callable[[], float], seed: int,
                 partitions: int = 4) -> None:
        if partitions <= 0:
            raise EventLogError(f"partitions must be positive, got {partitions}")
        self.router = Router(router_config, clock=clock, rng=random.Random(seed))
        self._codec = EventCodec()
        self._fold = LogFold(self.router, self._codec)
        self._partitions: list[list[tuple[int, bytes]]] = [[] for _ in range(partitions)]
        self._writers: dict[int, EventBatcher] = {}
        #: Batches cut per worker since the last sync.
        self._cut: dict[int, list[EventBatch]] = {}
        self._events = 0

    def writer(self, worker_id: int) -> EventBatcher:
        """Batches as a publisher's (one epoch, ids from 1 per rank, starting with
        ``cleared``), published at each sync."""
        batches = self._cut[worker_id] = []
        opts = PublisherOptions(worker_id, lease_ms=SIM_LEASE_MS)
        w = self._writers[worker_id] = EventBatcher(
            worker_id, SIM_LEASE_MS, opts.max_batch_events, opts.max_batch_blocks,
            lambda batch, _blocks: batches.append(batch),
        )
        w.start_epoch(1)
        return w

    def sync(self, now_ms: int) -> None:
        for wid in sorted(self._writers):
            self._writers[wid].cut()
            batches = self._cut[wid]
            for batch in batches:
                self._events += len(batch.events)
                self._partitions[wid % len(self._partitions)].append((now_ms, self._codec.encode(batch)))
            batches.clear()
        for p, records in enumerate(self._partitions):
            start = self._fold.partitions[p].next_offset if p in self._fold.partitions else 0
            for offset in range(start, len(records)):
                ts, value = records[offset]
                self._fold.apply_record(p, offset, ts, value)

    @contextmanager
    def routing(self) -> Iterator[Router]:
        yield self.router

    def stats(self) -> LogStats:
        return LogStats(sum(len(r) for r in self._partitions), self._events, _counters(self._fold))

    def agree(self) -> bool:
        return True

    def close(self) -> None:
        pass


class KafkaEventLog:
    """Events published by one KafkaPublisher per worker on ``kvstream.events``, folded
    by ``replicas`` Replicas; routing uses the first one."""

    def __init__(self, settings: Settings, router_config: RouterConfig, clock: Callable[[], float], seed: int,
                 replicas: int = 1, timeout_s: float = 60.0) -> None:
        if replicas <= 0:
            raise EventLogError(f"replicas must be positive, got {replicas}")
        self.settings = settings
        self.timeout_s = timeout_s
        self._topic = settings.topics.name("events")
        self._publishers: dict[int, KafkaPublisher] = {}
        self.replicas: list[Replica] = []
        run = uuid.uuid4().hex[:8]
        try:
            for i in range(replicas):
                # No ticks after the first: they would only move log time, and leases are off.
                options = ReplicaOptions(tick_interval_s=365 * 24 * 3600.0, ready_max_lag=0,
                                         replica_id=f"simulate-{run}-{i}")
                r = Replica(settings, options, router_config, clock=clock)
                r.router.reseed(seed)
                r.start()
                self.replicas.append(r)
            self._consumer = Consumer(consumer_config(settings))
            partitions = topic_partitions(self._consumer, self._topic, 30)
        except KafkaException as exc:
            self.close()
            raise EventLogError(f"cannot reach Kafka at {settings.bootstrap}: {exc.args[0]}") from None
        except Exception:
            self.close()
            raise
        if not partitions:
            self.close()
            raise EventLogError(f"topic {self._topic} is missing (create it with `kvstream topics create`)")
        self._partitions = partitions
        self.router = self.replicas[0].router

    def writer(self, worker_id: int) -> KafkaPublisher:
        pub = KafkaPublisher(
            self.settings,
            PublisherOptions(worker_id, lease_ms=SIM_LEASE_MS, heartbeat_s=3600.0, listen_control=False),
        )
        self._publishers[worker_id] = pub
        return pub

    def sync(self, now_ms: int) -> None:
        for wid, pub in sorted(self._publishers.items()):
            if pub.flush(self.timeout_s):
                raise EventLogError(f"worker {wid}: Kafka did not acknowledge its events within {self.timeout_s}s")
            if pub.stats.delivery_failures:
                # A lost batch would make the routers' view diverge from the workers'.
                raise EventLogError(f"worker {wid}: Kafka refused {pub.stats.delivery_failures} of its batches")
        try:
            highs = end_offsets(self._consumer, self._topic, self._partitions, self.timeout_s)
        except KafkaException as exc:
            raise EventLogError(f"cannot read the end offsets of {self._topic}: {exc.args[0]}") from None
        deadline = time.monotonic() + self.timeout_s
        for r in self.replicas:
            while True:
                with r.lock:
                    done = r.fold.next_offsets()
                if all(done.get(p, 0) >= h for p, h in highs.items() if h > 0):
                    break
                if time.monotonic() > deadline:
                    raise EventLogError(f"replica {r.replica_id} did not fold the events within {self.timeout_s}s")
                time.sleep(0.0005)

    @contextmanager
    def routing(self) -> Iterator[Router]:
        with self.replicas[0].lock:
            yield self.router

    def stats(self) -> LogStats:
        return LogStats(
            sum(p.stats.batches for p in self._publishers.values()),
            sum(p.stats.events for p in self._publishers.values()),
            _counters(self.replicas[0].fold),
        )

    def agree(self) -> bool:
        views = []
        for r in self.replicas:
            with r.lock:
                views.append({w: r.router.export_worker(w) for w in sorted(r.fold.workers)})
        return all(v == views[0] for v in views[1:])

    def close(self) -> None:
        for pub in self._publishers.values():
            pub.close()
        for r in self.replicas:
            r.stop()
        consumer = getattr(self, "_consumer", None)
        if consumer is not None:
            consumer.close()
