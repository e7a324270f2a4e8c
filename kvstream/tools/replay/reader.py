"""Reading a range of a real topic: times → offsets (the broker's offsets-for-times),
per-partition ranges read in offset order, progress on stderr (tqdm), and nothing
left behind when the user presses Ctrl-C (the consumer is closed by the context).

Ranges are ``start`` (first offset read) and ``end`` (first offset NOT read) per
partition. Time bounds are on record timestamps, the same clock the fold uses for
leases, and a time range is a *prefix* cut of each partition (up to the first record
stamped after the bound): that is what a replica that had read the log up to that
moment held, even if a producer's clock put an older timestamp further on.
"""

from __future__ import annotations

import logging
import re
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition
from tqdm import tqdm

from kvstream.kafka.config import consumer_config
from kvstream.kafka.metadata import topic_partitions, watermarks
from kvstream.replica.record import Record, read_record
from kvstream.settings import Settings
from kvstream.tools.replay.errors import ReplayError, RetentionError, TopicMissingError

_RDKAFKA_LOG = logging.getLogger("kvstream.replay.librdkafka")
_RELATIVE = re.compile(r"^-(\d+(?:\.\d+)?)([smhd])$")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}


def parse_time(text: str, now: datetime | None = None) -> int:
    """Milliseconds since the epoch from ISO 8601 (``2026-11-29T10:00:00Z``; no zone
    means UTC), epoch milliseconds (``@1764410400000``), ``now``, or a time before now
    (``-10m``, ``-2h``, ``-30s``, ``-1d``)."""
    now = now or datetime.now(timezone.utc)
    t = text.strip()
    if t == "now":
        return int(now.timestamp() * 1000)
    if t.startswith("@") and t[1:].isdigit():
        return int(t[1:])
    m = _RELATIVE.match(t)
    if m:
        return int((now - timedelta(**{_UNITS[m.group(2)]: float(m.group(1))})).timestamp() * 1000)
    try:
        dt = datetime.fromisoformat(t)
    except ValueError:
        raise ReplayError(
            f"cannot read time {text!r}: give ISO 8601 (2026-11-29T10:00:00Z), "
            "@<epoch ms>, now, or -<n>s/m/h/d"
        ) from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return int(dt.timestamp() * 1000)


def format_time(ms: int) -> str:
    """ISO 8601 UTC with milliseconds (what ``parse_time`` reads back)."""
    dt = datetime.fromtimestamp(ms / 1000, timezone.utc)
    return dt.strftime("%Y-%m-%dT%H:%M:%S.") + f"{ms % 1000:03d}Z"


@dataclass(frozen=True, slots=True)
class Bounds:
    """What the user asked for: times (ms, inclusive) and/or offsets (inclusive), per
    partition (``None`` key: every partition), and which partitions to read."""

    from_ms: int | None = None
    to_ms: int | None = None
    from_offsets: dict[int | None, int] | None = None
    to_offsets: dict[int | None, int] | None = None
    partitions: frozenset[int] | None = None


def parse_offsets(specs: tuple[str, ...]) -> dict[int | None, int] | None:
    """``N`` (every partition) or ``P:N`` (partition P), repeatable."""
    if not specs:
        return None
    out: dict[int | None, int] = {}
    for spec in specs:
        part, _, off = spec.rpartition(":")
        try:
            value = int(off)
            key = int(part) if part else None
        except ValueError:
            raise ReplayError(f"cannot read offset {spec!r}: give N or PARTITION:N") from None
        if value < 0 or (key is not None and key < 0):
            raise ReplayError(f"offset {spec!r} is negative")
        out[key] = value
    return out


def _for(offsets: dict[int | None, int] | None, p: int) -> int | None:
    return None if offsets is None else offsets.get(p, offsets.get(None))


class LogReader:
    """One topic of the cluster, for reading ranges. Use as a context manager."""

    def __init__(self, settings: Settings, role: str = "events", timeout: float = 15.0) -> None:
        self.topic = settings.topics.name(role)
        self.timeout = timeout
        # librdkafka's connection chatter would bury the one line this tool prints when
        # Kafka cannot be reached; it shows with --log-level DEBUG.
        if not logging.getLogger().isEnabledFor(logging.DEBUG):
            _RDKAFKA_LOG.setLevel(logging.CRITICAL)
        # A fresh group that never commits (consumer_config), with partition EOF events:
        # they tell where a range that ends at the high watermark is done.
        self._consumer = Consumer(
            consumer_config(settings, **{"client.id": "kvstream-replay"}), logger=_RDKAFKA_LOG
        )
        self._closed = False
        try:
            partitions = topic_partitions(self._consumer, self.topic, timeout)
        except KafkaException as exc:
            self.close()
            raise ReplayError(f"cannot reach Kafka: {exc.args[0]}") from None
        if not partitions:
            self.close()
            raise TopicMissingError(
                f"topic {self.topic} does not exist (wrong --topic-prefix or --bootstrap? "
                "`kvstream topics create` makes it)"
            )
        self.partitions: tuple[int, ...] = partitions
        try:
            bounds = watermarks(self._consumer, self.topic, partitions, timeout)
        except KafkaException as exc:
            self.close()
            raise ReplayError(f"cannot read the offsets of {self.topic}: {exc.args[0]}") from None
        self.low: dict[int, int] = {p: low for p, (low, _) in bounds.items()}
        self.high: dict[int, int] = {p: high for p, (_, high) in bounds.items()}

    def __enter__(self) -> LogReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._consumer.close()

    # -- times → offsets ---------------------------------------------------------------

    def offsets_at(self, ts_ms: int) -> dict[int, int]:
        """Per partition, the first offset whose record timestamp is ≥ ``ts_ms`` (the
        high watermark when there is none)."""
        found = self._consumer.offsets_for_times(
            [TopicPartition(self.topic, p, ts_ms) for p in self.partitions], timeout=self.timeout
        )
        out = {}
        for tp in found:
            if tp.error is not None:
                raise ReplayError(f"offsets for time on partition {tp.partition}: {tp.error}")
            out[tp.partition] = tp.offset if tp.offset >= 0 else self.high[tp.partition]
        return out

    def offsets_after(self, ts_ms: int) -> dict[int, int]:
        """Per partition, the end of the prefix stamped at or before ``ts_ms``."""
        return self.offsets_at(ts_ms + 1)

    def check_retained(self, offsets: dict[int, int], what: str) -> None:
        """Refuse a time bound that falls on the first retained record of a partition
        whose start was deleted: records at or after that time may have been deleted.
        (A partition with nothing retained says nothing either way: it is let through.)"""
        lost = [p for p, off in offsets.items() if 0 < off == self.low[p] < self.high[p]]
        if lost:
            where = ", ".join(f"partition {p} keeps offsets from {self.low[p]}" for p in lost)
            raise RetentionError(
                f"{what} is before the retention horizon of {self.topic} ({where}): "
                "the records of that time were deleted"
            )

    def resolve(self, bounds: Bounds) -> tuple[dict[int, int], dict[int, int]]:
        """(start, end) offsets of the asked range, per partition read."""
        parts = self.partitions
        if bounds.partitions is not None:
            unknown = sorted(bounds.partitions - set(parts))
            if unknown:
                raise ReplayError(f"{self.topic} has no partition {unknown} (it has {len(parts)})")
            parts = tuple(p for p in parts if p in bounds.partitions)
        start = {p: self.low[p] for p in parts}
        end = {p: self.high[p] for p in parts}
        if bounds.from_ms is not None:
            at = self.offsets_at(bounds.from_ms)
            start = {p: at[p] for p in parts}
            self.check_retained(start, f"--from {format_time(bounds.from_ms)}")
        if bounds.to_ms is not None:
            at = self.offsets_after(bounds.to_ms)
            end = {p: at[p] for p in parts}
            self.check_retained(end, f"--to {format_time(bounds.to_ms)}")
        # Offsets given with times intersect them.
        for p in parts:
            first = _for(bounds.from_offsets, p)
            if first is not None:
                if first < self.low[p]:
                    raise RetentionError(
                        f"--from-offset {first} is below the earliest retained offset of "
                        f"{self.topic} partition {p} ({self.low[p]})"
                    )
                start[p] = max(start[p], first)
            last = _for(bounds.to_offsets, p)
            if last is not None:
                end[p] = min(end[p], last + 1)
        return start, end

    # -- reading -----------------------------------------------------------------------

    def read(
        self,
        start: dict[int, int],
        end: dict[int, int] | None,
        *,
        progress: bool | None = None,
        desc: str | None = None,
    ) -> Iterator[Record]:
        """Records of ``[start[p], end[p])`` per partition, each partition in offset
        order. ``end=None`` follows the log until interrupted. ``progress=None`` shows a
        bar only when stderr is a terminal."""
        follow = end is None
        todo = {p: s for p, s in start.items() if follow or s < end[p]}  # type: ignore[index]
        if not todo:
            return
        c = self._consumer
        c.assign([TopicPartition(self.topic, p, s) for p, s in todo.items()])
        total = None if follow else sum(end[p] - s for p, s in todo.items())  # type: ignore[index]
        bar = tqdm(
            total=total, desc=desc or self.topic, unit="rec", file=sys.stderr,
            disable=None if progress is None else not progress, leave=False,
        )
        active = set(todo)
        try:
            with _interrupt_flag(follow) as interrupted:
                yield from self._records(c, end, follow, active, bar, interrupted)
            if interrupted.is_set():
                raise KeyboardInterrupt
        finally:
            bar.close()
            if not self._closed:  # a generator dropped after close() ends here too
                c.unassign()

    def _records(
        self, c: Consumer, end: dict[int, int] | None, follow: bool, active: set[int], bar: tqdm,
        interrupted: threading.Event,
    ) -> Iterator[Record]:
        # Following ends only on Ctrl-C; a range ends when every partition is done.
        while not interrupted.is_set() if follow else active:
            for m in c.consume(1000, 0.2):
                p = m.partition()
                err = m.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        if not follow:
                            self._done(active, p)
                        continue
                    raise ReplayError(f"reading {self.topic} partition {p}: {err.str()}")
                if p not in active and not follow:
                    continue  # already fetched past its end
                off = m.offset()
                if not follow and off >= end[p]:  # type: ignore[index]
                    self._done(active, p)
                    continue
                bar.update(1)
                yield read_record(m)
                if not follow and off + 1 >= end[p]:  # type: ignore[index]
                    self._done(active, p)

    def _done(self, active: set[int], p: int) -> None:
        if p in active:
            active.discard(p)
            self._consumer.pause([TopicPartition(self.topic, p)])


@contextmanager
def _interrupt_flag(follow: bool) -> Iterator[threading.Event]:
    """While following the log from the main thread, Ctrl-C sets a flag that the read
    loop checks between polls, instead of raising wherever Python happens to be: a
    KeyboardInterrupt raised inside one of librdkafka's callbacks (its log lines come
    through one) can be lost, and the follow never ends."""
    flag = threading.Event()
    if not follow or threading.current_thread() is not threading.main_thread():
        yield flag
        return
    previous = signal.signal(signal.SIGINT, lambda *_: flag.set())
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, previous)

