"""What a Kafka client really sends: librdkafka's own statistics (its ``stats_cb``),
for the benchmarks that report bytes on the wire and records per produce request."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: How often librdkafka reports (ms); the meter waits a little longer than this for a
#: report that covers everything sent.
INTERVAL_MS = 50


@dataclass(frozen=True, slots=True)
class WireTotals:
    #: Bytes sent to brokers: produce requests with their record batches, and the few
    #: metadata and other requests.
    tx_bytes: int
    produce_requests: int
    #: Records acknowledged by brokers.
    records: int

    def __sub__(self, other: WireTotals) -> WireTotals:
        return WireTotals(
            self.tx_bytes - other.tx_bytes,
            self.produce_requests - other.produce_requests,
            self.records - other.records,
        )


class WireMeter:
    """Collects the statistics of one producer: add ``config()`` to its settings, and
    read ``totals(poll)`` with the producer's poll (or flush) function."""

    def __init__(self) -> None:
        self._last: dict[str, Any] | None = None

    def config(self) -> dict[str, Any]:
        return {"statistics.interval.ms": INTERVAL_MS, "stats_cb": self._on_stats}

    def _on_stats(self, raw: str) -> None:
        self._last = json.loads(raw)

    def totals(self, poll: Callable[[float], object]) -> WireTotals:
        """Cumulative totals as of now (waits for one fresh report)."""
        self._last = None
        deadline = time.monotonic() + 10 * INTERVAL_MS / 1000 + 1
        while self._last is None and time.monotonic() < deadline:
            poll(INTERVAL_MS / 1000)
        if self._last is None:
            raise RuntimeError("librdkafka sent no statistics")
        brokers = self._last.get("brokers", {}).values()
        return WireTotals(
            tx_bytes=sum(b.get("txbytes", 0) for b in brokers),
            produce_requests=sum(b.get("req", {}).get("Produce", 0) for b in brokers),
            records=int(self._last.get("txmsgs", 0)),
        )
