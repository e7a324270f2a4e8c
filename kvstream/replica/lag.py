"""A replica's lag thread: how far the fold is behind the log, readiness, staleness,
and partitions added to the events topic while the replica runs.

Its own thread, asking a consumer that never fetches (on the fetching one each query
would wait behind a long-poll fetch): a slow broker answer never stalls ingest. Ready
once caught up (every partition's lag at most ``ready_max_lag``) with no worker dropped
at recovery still to resync; once ready, a replica that falls behind or loses the
broker keeps routing, each decision marked stale (:meth:`LagWatch.staleness`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from datetime import datetime, timezone
from typing import Any

from confluent_kafka import Consumer, KafkaException

from kvstream.kafka.metadata import topic_partitions
from kvstream.logs import get_logger
from kvstream.replica.errors import RecoveryError
from kvstream.replica.fold import LogFold
from kvstream.replica.ingest import Partitions
from kvstream.replica.metrics import ReplicaMetrics
from kvstream.replica.recovery import read_bounds
from kvstream.replica.resync import AwaitedResyncs
from kvstream.replica.snapshotter import Snapshotter

log = get_logger(__name__)

#: How long one look at the watermarks may take (s).
LAG_QUERY_TIMEOUT_S = 5.0
#: Between two looks (s).
LAG_INTERVAL_S = 0.5
#: Between two looks until the replica is first ready (s): a restart that waited a whole
#: interval for a look after it caught up would refuse requests meanwhile.
START_LAG_INTERVAL_S = 0.05


def iso(t: float) -> str:
    """Wall-clock seconds as ISO 8601 UTC with milliseconds."""
    return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="milliseconds")


class LagWatch:
    """:meth:`run` is the lag thread; the rest is read from any thread."""

    def __init__(
        self,
        replica_id: str,
        topic: str,
        offsets_consumer: Consumer,
        lock: AbstractContextManager[Any],
        fold: LogFold,
        partitions: Partitions,
        positions: Callable[[], dict[int, int]],
        awaited: AwaitedResyncs,
        ready: threading.Event,
        metrics: ReplicaMetrics,
        stop: threading.Event,
        progress: Callable[[], None],
        *,
        snapshotter: Snapshotter | None,
        ready_max_lag: int,
        metadata_interval_s: float,
        started_at: float,
    ) -> None:
        self.replica_id = replica_id
        self._topic = topic
        self._consumer = offsets_consumer
        self._lock = lock
        self._fold = fold
        self._partitions = partitions
        self._positions = positions
        self._awaited = awaited
        self._ready = ready
        self._metrics = metrics
        self._stop = stop
        self._progress = progress
        self._snapshotter = snapshotter
        self.ready_max_lag = ready_max_lag
        self._metadata_interval_s = metadata_interval_s
        self._started_at = started_at
        self._last_metadata = time.monotonic()
        self.lag: dict[int, int] = {}
        #: Wall-clock time since when the index has been known to be behind (lag past
        #: ready_max_lag) and since when the broker has not answered, or None.
        self.behind_since: float | None = None
        self.broker_down_since: float | None = None

    def run(self) -> None:
        while not self._stop.is_set():
            if time.monotonic() - self._last_metadata >= self._metadata_interval_s:
                self._check_partitions()
            self._update_lag()
            self._progress()
            self._stop.wait(LAG_INTERVAL_S if self._ready.is_set() else START_LAG_INTERVAL_S)

    def lagging(self) -> dict[int, int]:
        """Partitions whose lag is past ``ready_max_lag`` → their lag (records)."""
        return {p: n for p, n in self.lag.items() if n > self.ready_max_lag}

    def staleness(self) -> dict[str, object] | None:
        """Why the index is known to be behind, or None: lag past ``ready_max_lag``
        (records, and since when) and/or the broker unreachable (since when)."""
        out: dict[str, object] = {}
        if self.behind_since is not None:
            lagging = {str(p): n for p, n in self.lagging().items()}
            out.update(lag_records=sum(lagging.values()), lagging_partitions=lagging,
                       behind_since=iso(self.behind_since))
        if self.broker_down_since is not None:
            out["broker_unreachable_since"] = iso(self.broker_down_since)
        return out or None

    def _check_partitions(self) -> None:
        """Find partitions added to the events topic since the last check."""
        self._last_metadata = time.monotonic()
        try:
            count = len(topic_partitions(self._consumer, self._topic, 10))
        except KafkaException as exc:
            log.warning("metadata check failed", error=str(exc))
            return
        if count <= self._partitions.count:
            return
        with self._lock:
            added = self._partitions.grow(count)
            if self._snapshotter is not None:
                self._snapshotter.partition_count = count
        self._metrics.partitions.set(count)
        log.warning("events topic has new partitions", replica=self.replica_id, added=added, partitions=count)

    def _update_lag(self) -> None:
        offsets = self._positions()
        try:
            bounds = read_bounds(self._consumer, self._topic, self._partitions.count, LAG_QUERY_TIMEOUT_S,
                                 retry=False)
        except RecoveryError as exc:
            # Leases run in log time, so nothing expires while no record arrives: say
            # that the index is frozen rather than report a lag of 0.
            if self.broker_down_since is None:
                self.broker_down_since = time.time()
                self._metrics.broker_unreachable.set(1)
                log.error("broker unreachable: routing goes on with the index as it stands, marked stale",
                          replica=self.replica_id, error=str(exc))
            self._mark_stale()
            return
        if self.broker_down_since is not None:
            log.warning("broker reachable again", replica=self.replica_id,
                        after_s=round(time.time() - self.broker_down_since, 1))
            self.broker_down_since = None
            self._metrics.broker_unreachable.set(0)
        lag = {}
        for p, (_, high) in bounds.items():
            lag[p] = max(0, high - offsets.get(p, 0))
            self._metrics.lag.labels(partition=str(p)).set(lag[p])
        self.lag = lag
        caught_up = all(v <= self.ready_max_lag for v in lag.values())
        if not self._ready.is_set():
            # The start-up gate: a replica's index is not the fleet's until it has caught up.
            if caught_up and not self._resyncs_pending():
                after_s = time.monotonic() - self._started_at
                log.info("ready", replica=self.replica_id, after_s=round(after_s, 3))
                self._ready.set()
            return
        if caught_up:
            if self.behind_since is not None:
                log.info("caught up again", replica=self.replica_id,
                         after_s=round(time.time() - self.behind_since, 1))
            self.behind_since = None
        elif self.behind_since is None:
            self.behind_since = time.time()
            log.warning("behind the log: routing goes on, decisions marked stale", replica=self.replica_id,
                        lag=sum(lag.values()), ready_max_lag=self.ready_max_lag)
        self._mark_stale()

    def _resyncs_pending(self) -> bool:
        with self._lock:
            return self._awaited.pending(self._fold.workers)

    def _mark_stale(self) -> None:
        self._metrics.stale.set(0 if self.staleness() is None else 1)
