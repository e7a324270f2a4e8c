"""Prometheus metrics of a worker (publisher, engine bridge, consolidator).

The components keep plain counters (no cost on the hot path); this collector reads them
when Prometheus scrapes. Each worker gets its own registry, so that several workers (or
tests) in one process do not collide.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvstream.worker.consolidator import Anomaly, Consolidator
from kvstream.worker.publisher import KafkaPublisher
from kvstream.worker.engine_events import Issue
from kvstream.worker.zmq_bridge import ZmqEngineBridge


class WorkerCollector(Collector):
    def __init__(
        self,
        publisher: KafkaPublisher,
        consolidator: Consolidator,
        bridge: ZmqEngineBridge | None = None,
    ) -> None:
        self._publisher = publisher
        self._consolidator = consolidator
        self._bridge = bridge

    def collect(self) -> Iterator[Metric]:
        p = self._publisher.stats
        counters = [
            ("kvstream_worker_batches_published", "Event batches handed to Kafka (heartbeats included)", p.batches),
            ("kvstream_worker_batches_acked", "Event batches acknowledged by Kafka", p.acked_batches),
            ("kvstream_worker_events_published", "Router events handed to Kafka", p.events),
            ("kvstream_worker_events_acked", "Router events acknowledged by Kafka", p.acked_events),
            ("kvstream_worker_blocks_published", "Block hashes in published events", p.blocks),
            ("kvstream_worker_blocks_acked", "Block hashes in acknowledged events", p.acked_blocks),
            ("kvstream_worker_heartbeats", "Empty batches sent as heartbeats", p.heartbeats),
            ("kvstream_worker_delivery_failures", "Batches Kafka failed to take (each leads to a resync)", p.delivery_failures),
            ("kvstream_worker_queue_full_waits", "Times the producer queue was full", p.queue_full_waits),
            ("kvstream_worker_resyncs", "Full-state republications under a new epoch", p.resyncs),
            ("kvstream_worker_resync_requests", "Resync requests for this worker read from the control topic", p.resync_requests),
            ("kvstream_worker_control_errors", "Control records that could not be read", p.control_errors),
        ]
        for name, doc, value in counters:
            yield CounterMetricFamily(name, doc, value=value)
        yield GaugeMetricFamily(
            "kvstream_worker_queue_depth", "Messages in the producer not yet acknowledged", value=self._publisher.queue_depth
        )
        yield GaugeMetricFamily("kvstream_worker_epoch", "Current epoch (worker incarnation)", value=self._publisher.epoch)
        yield GaugeMetricFamily(
            "kvstream_worker_blocks_held", "Distinct blocks held by any source", value=self._consolidator.block_count()
        )
        anomalies = CounterMetricFamily(
            "kvstream_worker_consolidator_anomalies", "Source events (or blocks) not applied, by reason", labels=["reason"]
        )
        for reason in Anomaly:
            anomalies.add_metric([reason.value], self._consolidator.anomalies[reason])
        yield anomalies
        reannounced = CounterMetricFamily(
            "kvstream_worker_blocks_reannounced",
            "Blocks a source stored again while holding them (re-announced cached prefixes), by source tier",
            labels=["tier"],
        )
        for tier, n in sorted(self._consolidator.reannounced.items()):
            reannounced.add_metric([tier.value], n)
        yield reannounced
        if self._bridge is not None:
            b = self._bridge
            yield CounterMetricFamily("kvstream_worker_engine_messages", "Engine messages handled", value=b.stats.messages)
            yield CounterMetricFamily("kvstream_worker_engine_events", "Engine events converted", value=b.stats.events)
            yield CounterMetricFamily("kvstream_worker_engine_replayed", "Engine messages recovered by replay", value=b.stats.replayed)
            yield CounterMetricFamily("kvstream_worker_engine_gaps", "Engine messages missed (sequence gaps)", value=b.issues[Issue.GAP])
            issues = CounterMetricFamily(
                "kvstream_worker_engine_issues", "Engine input skipped or missing, by issue", labels=["issue"]
            )
            for issue in Issue:
                issues.add_metric([issue.value], b.issues[issue])
            yield issues


def serve_metrics(port: int, collector: WorkerCollector, addr: str = "0.0.0.0") -> CollectorRegistry:
    """Serve ``collector`` on ``http://addr:port/metrics`` (a daemon thread)."""
    registry = CollectorRegistry()
    registry.register(collector)
    start_http_server(port, addr=addr, registry=registry)
    return registry
