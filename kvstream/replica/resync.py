"""A replica's resync requests on ``kvstream.control`` (DESIGN.md §7), and the wait for
the workers that recovery dropped.

The fold asks for a resync when the log cannot tell what a worker holds (a gap, an id
conflict, a stale or moved epoch). Asked while reading the log's history (below the end
the replica started at), the problem may have healed long ago: the request is deferred
until the replica has caught up, and sent only if the worker has started no newer epoch
since. Requests for one worker go out at most every ``min_interval_s``.

The decisions that read the fold (:meth:`ResyncRequester.asked`,
:meth:`ResyncRequester.unhealed`, :meth:`AwaitedResyncs.pending`) run under the router
lock; :meth:`ResyncRequester.request`, which produces, runs outside it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from kvstream.events.codec import AvroCodec
from kvstream.events.control import MAX_REASON_CHARS, RESYNC_REQUEST, ResyncRequest
from kvstream.kafka.producer import CountingProducer
from kvstream.replica.fold import WorkerLog
from kvstream.replica.metrics import ReplicaMetrics


@dataclass(frozen=True, slots=True)
class Resync:
    """A resync to request: of ``worker_id`` (None: every worker), above an epoch."""

    worker_id: int | None
    reason: str
    above_epoch: int | None = None


class ResyncRequester:
    """Rate-limits, defers and writes one replica's resync requests."""

    def __init__(
        self,
        replica_id: str,
        producer: CountingProducer,
        topic: str,
        min_interval_s: float,
        metrics: ReplicaMetrics,
        codec: AvroCodec | None = None,
    ) -> None:
        self.replica_id = replica_id
        self._producer = producer
        self._topic = topic
        self._min_interval_s = min_interval_s
        self._metrics = metrics
        self._codec = codec if codec is not None else AvroCodec()
        self._last: dict[int | None, float] = {}
        #: Each partition's end offset when the replica started: resyncs the fold asks
        #: for below it are history, requested after catch-up only if still unhealed.
        self.history_end: dict[int, int] = {}
        #: worker id → (epoch the fold held when history asked for its resync, why).
        self._deferred: dict[int, tuple[int, str]] = {}

    def request(self, resync: Resync) -> None:
        """Write the request, unless one for the same worker went out less than
        ``min_interval_s`` ago."""
        now = time.monotonic()
        last = self._last.get(resync.worker_id)
        if last is not None and now - last < self._min_interval_s:
            return
        self._last[resync.worker_id] = now
        self._metrics.resync_requests.inc()
        request = ResyncRequest(resync.worker_id, self.replica_id, resync.reason[:MAX_REASON_CHARS],
                                int(time.time() * 1000), resync.above_epoch)
        self._producer.produce("resync", self._topic, value=self._codec.encode(RESYNC_REQUEST, request.to_record()))

    def asked(self, partition: int, offset: int, wid: int, why: str | None, held: WorkerLog | None) -> Resync | None:
        """The fold asks ``wid`` to resync at ``partition``/``offset`` (``held``: what
        it holds of the worker now): the request to make now, or None when deferred."""
        reason = (why or "event id gap or epoch without cleared").split(";")[0]
        if offset + 1 < self.history_end.get(partition, 0):
            if held is not None:
                self._deferred[wid] = (held.epoch, reason)
            return None
        return Resync(wid, reason, None if held is None else held.epoch)

    def unhealed(self, positions: Mapping[int, int], workers: Mapping[int, WorkerLog]) -> list[Resync]:
        """Once ``positions`` reach the end the replica started at: the deferred
        resyncs the log has not healed (the worker is still at the epoch it had then),
        to request now; the rest are dropped (counted as healed)."""
        if not self._deferred or any(positions.get(p, 0) < end for p, end in self.history_end.items()):
            return []
        deferred, self._deferred = self._deferred, {}
        due = []
        for wid, (epoch, reason) in deferred.items():
            held = workers.get(wid)
            if held is not None and held.epoch <= epoch:
                due.append(Resync(wid, f"{reason} (still unhealed on the log)", held.epoch))
            else:
                self._metrics.resyncs_healed.inc()
        return due

    @property
    def deferring(self) -> bool:
        return bool(self._deferred)


class AwaitedResyncs:
    """Workers that recovery dropped (retention, a recreated topic), each with the epoch
    it had: the replica stays unready until each has resynced (a newer epoch on the
    log), or at most ``wait_s``."""

    def __init__(self, wait_s: float, note: Callable[[str], None]) -> None:
        self.wait_s = wait_s
        self._note = note
        self._epochs: dict[int, int] = {}
        self._until = 0.0

    def add(self, dropped: Mapping[int, int]) -> None:
        self._epochs.update(dropped)
        self._until = time.monotonic() + self.wait_s

    def workers(self) -> list[int]:
        return sorted(self._epochs)

    def pending(self, workers: Mapping[int, WorkerLog]) -> bool:
        """Whether one has not resynced yet and the wait has not run out (call with
        the router lock held: ``workers`` is the fold's)."""
        if not self._epochs:
            return False
        for wid, epoch in list(self._epochs.items()):
            if wid in workers and workers[wid].epoch > epoch:
                del self._epochs[wid]
        if self._epochs and time.monotonic() >= self._until:
            self._note(f"workers did not resync within {self.wait_s}s: {sorted(self._epochs)}")
            self._epochs.clear()
        return bool(self._epochs)
