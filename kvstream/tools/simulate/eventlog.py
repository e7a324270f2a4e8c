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

from confluent_kafka import Consumer, KafkaException, TopicPartition

from kvstream.events.codec import EventCodec
from kvstream.events.model import Cleared, EventBatch, Removed, RouterEvent, Stored, Tier
from kvstream.kafka.config import consumer_config
from kvstream.replica.fold import LogFold
from kvstream.replica.replica import Replica, ReplicaOptions
from kvstream.router import Router, RouterConfig
from kvstream.settings import Settings
from kvstream.tools.simulate.errors import EventLogError
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


class MemoryWriter:
    """A :class:`RouterEventWriter` that stamps events like a publisher (one epoch, ids
    from 1 per rank, starting with ``cleared``) and cuts them into one batch per sync."""

    def __init__(self, worker_id: int, epoch: int = 1) -> None:
        self.worker_id = worker_id
        self.epoch = epoch
        self._next_id: dict[int, int] = {}
        self._pending: list[RouterEvent] = []
        self.cleared(0)

    def _id(self, dp_rank: int) -> int:
        eid = self._next_id.get(dp_rank, 1)
        self._next_id[dp_rank] = eid + 1
        return eid

    def stored(self, dp_rank: int, tier: Tier, parent_hash: int | None, block_hashes: list[int],
               tokens_hashes: list[int]) -> None:
        self._pending.append(Stored(self.worker_id, dp_rank, tier, self.epoch, self._id(dp_rank), parent_hash,
                                    tuple(block_hashes), tuple(tokens_hashes)))

    def removed(self, dp_rank: int, tier: Tier, block_hashes: list[int]) -> None:
        self._pending.append(Removed(self.worker_id, dp_rank, tier, self.epoch, self._id(dp_rank),
                                     tuple(block_hashes)))

    def cleared(self, dp_rank: int, tier: Tier = Tier.DEVICE) -> None:
        self._pending.append(Cleared(self.worker_id, dp_rank, tier, self.epoch, self._id(dp_rank)))

    def cut(self) -> EventBatch | None:
        if not self._pending:
            return None
        batch = EventBatch(self.worker_id, self.epoch, SIM_LEASE_MS, tuple(self._pending))
        self._pending = []
        return batch


class MemoryEventLog:
    """A partitioned log in memory (lists of encoded records), folded by one LogFold."""

    def __init__(self, router_config: RouterConfig, clock: Callable[[], float], seed: int,
                 partitions: int = 4) -> None:
        if partitions <= 0:
            raise EventLogError(f"partitions must be positive, got {partitions}")
        self.router = Router(router_config, clock=clock, rng=random.Random(seed))
        self._codec = EventCodec()
        self._fold = LogFold(self.router, self._codec.decode)
        self._partitions: list[list[tuple[int, bytes]]] = [[] for _ in range(partitions)]
        self._writers: dict[int, MemoryWriter] = {}
        self._events = 0

    def writer(self, worker_id: int) -> MemoryWriter:
        w = self._writers[worker_id] = MemoryWriter(worker_id)
        return w

    def sync(self, now_ms: int) -> None:
        for wid in sorted(self._writers):
            batch = self._writers[wid].cut()
            if batch is not None:
                self._events += len(batch.events)
                self._partitions[wid % len(self._partitions)].append((now_ms, self._codec.encode(batch)))
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
            md = self._consumer.list_topics(self._topic, timeout=30).topics.get(self._topic)
        except KafkaException as exc:
            self.close()
            raise EventLogError(f"cannot reach Kafka at {settings.bootstrap}: {exc.args[0]}") from None
        except Exception:
            self.close()
            raise
        if md is None or md.error is not None:
            self.close()
            raise EventLogError(f"topic {self._topic} is missing (create it with `kvstream topics create`)")
        self._partitions = sorted(md.partitions)
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
            highs = {
                p: self._consumer.get_watermark_offsets(TopicPartition(self._topic, p), timeout=self.timeout_s,
                                                        cached=False)[1]
                for p in self._partitions
            }
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
