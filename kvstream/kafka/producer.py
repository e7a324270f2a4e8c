"""A producer for records whose loss must not stop the caller (a replica's DLQ copies,
resync requests, ticks, load ops): it never raises. A record the client refuses at once
(too large, queue full, a header it cannot take) is *refused*; one that Kafka finally
fails to take, after librdkafka's own retries, has *failed*. Both are counted per
purpose (``what``), logged, and reported to the owner's hooks (its metrics).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from functools import partial
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Producer

from kvstream.logs import get_logger

log = get_logger(__name__)

#: ``(what, error name)`` of a refused record; ``(what, error)`` of a failed delivery.
ProduceHook = Callable[[str, str], None]


def _ignore(_what: str, _error: str) -> None:
    return None


class CountingProducer:
    """``confluent_kafka.Producer`` whose ``produce`` counts failures instead of raising."""

    def __init__(
        self, config: dict[str, Any], *, on_refused: ProduceHook = _ignore, on_failed: ProduceHook = _ignore
    ) -> None:
        # Reports of failed deliveries only: a report per delivered record would run a
        # Python callback each (three per relayed request, on the replica's event loop).
        self._producer: Producer | None = Producer({**config, "delivery.report.only.error": True})
        self._on_refused = on_refused
        self._on_failed = on_failed
        #: (what, error name) → records refused at once.
        self.refused: Counter[tuple[str, str]] = Counter()
        #: what → records whose delivery failed.
        self.failed: Counter[str] = Counter()

    def produce(self, what: str, topic: str, *, poll: bool = True, **kw: Any) -> bool:
        """Hand a record to the client; False (counted, logged) when it refuses it.
        ``poll``: serve delivery reports now, else at the owner's next :meth:`poll`."""
        producer = self._producer
        if producer is None:
            self._refuse(what, topic, "closed", "the producer is closed")
            return False
        try:
            producer.produce(topic, on_delivery=partial(self._delivery, what), **kw)
            accepted = True
        except Exception as exc:  # noqa: BLE001 - never raise: e.g. a header the client refuses
            error = (exc.args[0].name() if isinstance(exc, KafkaException) and exc.args
                     and isinstance(exc.args[0], KafkaError) else type(exc).__name__)
            self._refuse(what, topic, error, str(exc))
            accepted = False
        if poll:
            producer.poll(0)
        return accepted

    def _refuse(self, what: str, topic: str, error: str, detail: str) -> None:
        self.refused[(what, error)] += 1
        self._on_refused(what, error)
        log.error("produce refused", what=what, topic=topic, error=detail)

    def _delivery(self, what: str, err: KafkaError | None, _msg: Any) -> None:
        if err is None:
            return
        self.failed[what] += 1
        self._on_failed(what, err.name())
        log.error("produce failed", what=what, error=str(err))

    def poll(self, timeout: float = 0) -> int:
        """Serve reports of failed deliveries (the hooks run here); returns how many were served."""
        return 0 if self._producer is None else self._producer.poll(timeout)

    def flush(self, timeout: float) -> int:
        """Wait up to ``timeout`` s for every record's delivery; returns how many are
        still undelivered."""
        return 0 if self._producer is None else self._producer.flush(timeout)

    def close(self) -> None:
        """Release the client (it stops dialling the broker); what is produced after
        is refused (``closed``). Flush first to wait for what is queued."""
        self._producer = None
