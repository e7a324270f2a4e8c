"""A replica's read positions, committed to a consumer group of its own (DESIGN.md §7),
so that Kafka's lag tooling (``kafka-consumer-groups --describe``, exporters, cloud
consoles) shows how far each replica is behind.

The group is only a place to report positions: the replica still ``assign()``s every
partition at its snapshot's offsets and never reads a committed offset back (the
snapshot is the truth; a position committed before a crash may be ahead of the snapshot
the replica restarts from). Commits are asynchronous, at most every ``interval_s`` and
only when a position moved; failures are counted, never fatal. One replica, one group
(``replica_group_id``): a stable ``replica_id`` keeps the group across restarts.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from kvstream.logs import get_logger

log = get_logger(__name__)


def replica_group_id(replica_id: str) -> str:
    """The consumer group a replica commits its positions to."""
    return f"kvstream-{replica_id}"


class PositionCommitter:
    """Commits ``positions()`` (partition → next offset to read) for ``consumer``."""

    def __init__(
        self,
        consumer: Consumer,
        topic: str,
        interval_s: float,
        on_failure: Callable[[str], None],
    ) -> None:
        self._consumer = consumer
        self._topic = topic
        self.interval_s = interval_s
        self._on_failure = on_failure
        self._last_time = float("-inf")
        self._last: dict[int, int] = {}

    def step(self, positions: Callable[[], dict[int, int]]) -> bool:
        """If due, commit ``positions()`` asynchronously when they moved; returns
        whether it committed."""
        now = time.monotonic()
        if self.interval_s <= 0 or now - self._last_time < self.interval_s:
            return False
        self._last_time = now
        current = positions()
        return current != self._last and self._commit(current, asynchronous=True)

    def final(self, positions: dict[int, int]) -> None:
        """On stop: the last positions, waiting for the broker's answer."""
        if self.interval_s > 0 and positions != self._last:
            self._commit(positions, asynchronous=False)

    def _commit(self, positions: dict[int, int], *, asynchronous: bool) -> bool:
        if not positions:
            return False
        offsets = [TopicPartition(self._topic, p, o) for p, o in sorted(positions.items())]
        try:
            self._consumer.commit(offsets=offsets, asynchronous=asynchronous)
        except KafkaException as exc:
            self._on_failure(str(exc.args[0]))
            return False
        self._last = dict(positions)
        return True


def commit_callback(on_failure: Callable[[str], None]) -> Callable[[KafkaError | None, list[TopicPartition]], None]:
    """librdkafka's ``on_commit`` for asynchronous commits: report failed ones."""

    def on_commit(err: KafkaError | None, partitions: list[TopicPartition]) -> None:
        failed = [f"{tp.partition}: {tp.error}" for tp in partitions if tp.error is not None]
        if err is not None or failed:
            on_failure(str(err) if err is not None else "; ".join(failed))

    return on_commit
