"""What the broker says of a topic: whether it exists, its partitions, and their
watermarks, asked the same way by every reader (replicas, workers, tools).

Any client answers (``Consumer``, ``Producer`` and ``AdminClient`` all have
``list_topics``); watermarks need a ``Consumer``. A broker that does not answer is a
``KafkaException`` for the caller to word; a topic that is not there is not an error here.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any, Protocol

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

#: Errors that pass by themselves: a just-created topic whose leaders are still being
#: elected, a leader moving, a broker slow to answer or reconnecting. librdkafka does not
#: flag these as retriable on a watermark query, so they are named.
TRANSIENT = frozenset({
    KafkaError.NOT_LEADER_FOR_PARTITION,
    KafkaError.LEADER_NOT_AVAILABLE,
    KafkaError.UNKNOWN_TOPIC_OR_PART,
    KafkaError._UNKNOWN_PARTITION,
    KafkaError.REQUEST_TIMED_OUT,
    KafkaError.NETWORK_EXCEPTION,
    KafkaError._TIMED_OUT,
    KafkaError._TRANSPORT,
    KafkaError._ALL_BROKERS_DOWN,
})
#: Pause between two tries of a query that failed transiently (s).
RETRY_PAUSE_S = 0.1


class MetadataClient(Protocol):
    """Any confluent_kafka client: they all answer metadata requests."""

    def list_topics(self, topic: str | None = None, timeout: float = -1) -> Any: ...


def is_transient(error: KafkaError) -> bool:
    """Whether asking again may succeed (:data:`TRANSIENT`, or flagged retriable)."""
    return error.retriable() or error.code() in TRANSIENT


def topic_partitions(client: MetadataClient, topic: str, timeout: float) -> tuple[int, ...]:
    """The topic's partition ids, sorted; () when the topic does not exist (or the
    broker reports it with an error). KafkaException when the broker does not answer."""
    md = client.list_topics(topic, timeout=timeout).topics.get(topic)
    if md is None or md.error is not None:
        return ()
    return tuple(sorted(md.partitions))


def watermarks(
    consumer: Consumer, topic: str, partitions: Iterable[int], timeout: float, *, retry: bool = True
) -> dict[int, tuple[int, int]]:
    """(earliest, end) offset of each of ``partitions``, asked of the broker (never the
    client's cache). Within ``timeout`` s in all: each query waits at most what is left
    (at least 0.1 s), and with ``retry`` a transient failure (:func:`is_transient`) is
    asked again while time is left. Otherwise the KafkaException is raised."""
    deadline = time.monotonic() + timeout
    out: dict[int, tuple[int, int]] = {}
    for p in partitions:
        tp = TopicPartition(topic, p)
        while True:
            try:
                out[p] = consumer.get_watermark_offsets(
                    tp, timeout=max(0.1, deadline - time.monotonic()), cached=False
                )
                break
            except KafkaException as exc:
                err = exc.args[0] if exc.args and isinstance(exc.args[0], KafkaError) else None
                if not retry or err is None or not is_transient(err) or time.monotonic() >= deadline:
                    raise
                time.sleep(RETRY_PAUSE_S)
    return out


def end_offsets(consumer: Consumer, topic: str, partitions: Iterable[int], timeout: float, *,
                retry: bool = True) -> dict[int, int]:
    """The next offset to be written of each of ``partitions`` (:func:`watermarks`)."""
    return {p: high for p, (_, high) in watermarks(consumer, topic, partitions, timeout, retry=retry).items()}
