"""Log-clock ticks on ``kvstream.events`` (DESIGN.md §7).

A worker silent for longer than its lease is removed when its partition's log time
(the largest record timestamp read there) passes its deadline. On a partition where
nothing else is written, a replica writes a *tick* so that log time moves: a record
marked by the ``kvstream-tick`` header, keyed by ``TICK_KEY`` (8 bytes, like a worker's
key, so that a consumer with a long key deserializer reads the whole topic), with a
``kvstream.events.Tick`` value saying who wrote it and for which deadline.

Ticks are written only where they change something: on a partition that holds a worker
whose lease deadline has passed (on this replica's clock) while the partition's log
time has not, at most once per ``interval_s`` per partition. A live worker's heartbeats
move log time themselves, and an empty partition has nothing to expire, so a healthy
log carries no ticks at all. The fold treats every tick alike: old ticks with a null
key and value (the log may still hold them) and new ones only advance log time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from kvstream.events.codec import AvroCodec
from kvstream.events.errors import DecodeError
from kvstream.events.model import TICK_HEADER
from kvstream.replica.fold import LogFold

TICK = "kvstream.events.Tick"
#: u64 max, big-endian: -1 to a LongDeserializer. The header, not the key, marks a tick
#: (any u64 is a valid worker id).
TICK_KEY = b"\xff" * 8
TICK_HEADERS = [(TICK_HEADER, b"")]


@dataclass(frozen=True, slots=True)
class Tick:
    replica_id: str
    deadline_ms: int


class TickCodec:
    """``Tick`` ↔ single-object Avro bytes of ``kvstream.events.Tick``."""

    def __init__(self, codec: AvroCodec | None = None) -> None:
        self.codec = codec if codec is not None else AvroCodec()

    def encode(self, tick: Tick) -> bytes:
        return self.codec.encode(TICK, {"replica_id": tick.replica_id, "deadline_ms": tick.deadline_ms})

    def decode(self, value: bytes | None) -> Tick | None:
        """The tick a value carries; None for an old tick without a value."""
        if value is None:
            return None
        name, record = self.codec.decode(value)
        if name != TICK:
            raise DecodeError(f"expected a {TICK} record, got {name}", reason="type")
        return Tick(record["replica_id"], record["deadline_ms"])


def due_partitions(fold: LogFold, now_ms: int) -> dict[int, int]:
    """Partition → its earliest lease deadline that ``now_ms`` has passed but the
    partition's log time has not: where a tick would remove a worker."""
    parts = fold.partitions
    due: dict[int, int] = {}
    for log in fold.workers.values():
        deadline = log.last_seen_ms + log.lease_ms
        if deadline >= now_ms:
            continue
        part = parts.get(log.partition)
        if part is not None and part.log_time_ms > deadline:
            continue  # already past it: the fold expires it on its next record
        if deadline < due.get(log.partition, deadline + 1):
            due[log.partition] = deadline
    return due


class Ticker:
    """Decides and writes one replica's ticks. ``produce(partition, key, value,
    headers)`` writes a record; ``clock`` gives wall-clock seconds (record timestamps
    are the producer's wall clock, so deadlines compare with it)."""

    def __init__(
        self,
        replica_id: str,
        interval_s: float,
        produce: Callable[[int, bytes, bytes, list[tuple[str, bytes]]], None],
        codec: TickCodec | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.replica_id = replica_id
        self.interval_s = interval_s
        self._produce = produce
        self._codec = codec if codec is not None else TickCodec()
        self._clock = clock
        self._last_check = float("-inf")
        self.written = 0

    def due(self) -> bool:
        """Whether :meth:`step` has anything to do now (asked without the fold's lock, so
        that the ingest loop takes the lock only when it must)."""
        return time.monotonic() - self._last_check >= self.interval_s

    def step(self, fold: LogFold) -> int:
        """At most every ``interval_s`` (so a tick has that long to land before the
        same deadline is ticked again): tick the partitions that need it. Call with the
        fold's lock held; returns how many ticks were written."""
        if not self.due():
            return 0
        self._last_check = time.monotonic()
        due = sorted(due_partitions(fold, int(self._clock() * 1000)).items())
        for partition, deadline in due:
            self._produce(partition, TICK_KEY, self._codec.encode(Tick(self.replica_id, deadline)), TICK_HEADERS)
        self.written += len(due)
        return len(due)
