"""Prometheus metrics of a replica (one registry per replica, served on /metrics)."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvstream.replica.snapshot import SnapshotMeta


class ReplicaMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.records = Counter("kvstream_records", "Records read from the events topic", registry=r)
        self.events_applied = Counter("kvstream_events_applied", "Router events applied to the index", registry=r)
        self.rejected = Gauge(
            "kvstream_events_rejected", "Events or blocks rejected or skipped, by reason", ["reason"], registry=r
        )
        self.dlq = Counter("kvstream_dlq_records", "Records copied to the DLQ", registry=r)
        self.consume_errors = Counter("kvstream_consume_errors", "Consumer errors", registry=r)
        self.produce_failures = Counter("kvstream_produce_failures", "Failed deliveries (DLQ, control, active)", registry=r)
        self.resync_requests = Counter("kvstream_resync_requests", "Resync requests published", registry=r)
        self.replica_id_conflicts = Counter(
            "kvstream_replica_id_conflicts",
            "Load ops of another running replica that carries this replica's id (ids must be unique)", registry=r,
        )
        self.resyncs_healed = Counter(
            "kvstream_resyncs_healed",
            "Resyncs the log's history asked for that a later epoch had already healed (not requested)", registry=r,
        )
        self.commit_failures = Counter(
            "kvstream_position_commit_failures", "Failed commits of read positions to the replica's group", registry=r
        )
        self.ticks = Counter("kvstream_ticks", "Log-clock ticks written to idle partitions past a lease", registry=r)
        self.lag = Gauge("kvstream_partition_lag", "Records behind the partition's end", ["partition"], registry=r)
        self.snapshot_age = Gauge(
            "kvstream_snapshot_age_seconds", "Seconds since the last committed snapshot", registry=r
        )
        self.snapshot_duration = Gauge(
            "kvstream_snapshot_duration_seconds", "Duration of the last snapshot", registry=r
        )
        self.snapshot_blocks = Gauge("kvstream_snapshot_blocks", "Blocks in the last snapshot", registry=r)
        self.snapshot_loaded_blocks = Gauge(
            "kvstream_snapshot_loaded_blocks", "Blocks restored from a snapshot at start", registry=r
        )
        self.snapshot_fallbacks = Counter(
            "kvstream_snapshot_fallbacks",
            "Snapshots not used at start, by what was skipped: a generation (then the previous one "
            "is tried), the whole store (moved aside or unusable), or all of it (a full replay)",
            ["skipped"], registry=r,
        )
        self.snapshot_write_failures = Counter(
            "kvstream_snapshot_write_failures", "Snapshot generations abandoned on a write error (retried)", registry=r
        )
        self.http_rejected = Counter(
            "kvstream_http_rejected",
            "Connections or requests refused by a limit (body_too_large, body_timeout, header_timeout, "
            "connections, busy)",
            ["limit"], registry=r,
        )
        self.route_latency = Histogram(
            "kvstream_route_latency_seconds",
            "Routing decision latency",
            buckets=(5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 5e-2),
            registry=r,
        )
        self.active_ops = Counter("kvstream_active_ops", "Active-sequence ops applied", ["source"], registry=r)
        self.routing_replicas = Gauge(
            "kvstream_routing_replicas",
            "Replicas seen routing in the last minute, this one included: each keeps its own part of a tie "
            "between candidates", registry=r,
        )
        self.active_op_lag = Histogram(
            "kvstream_active_op_lag_seconds",
            "From a peer's op (its route, first token or end) to this replica applying it: how late it sees "
            "its peers' load and predicted blocks", buckets=(0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 5),
            registry=r,
        )
        self.active_errors = Counter(
            "kvstream_active_op_errors", "Active-sequence ops that could not be applied", ["reason"], registry=r
        )
        self.http_errors = Counter("kvstream_http_errors", "HTTP requests answered with 4xx/5xx", ["status"], registry=r)
        self.thread_failures = Counter(
            "kvstream_thread_failures", "Failures of a replica thread (each restarted with backoff)", ["thread"], registry=r
        )
        self.thread_up = Gauge("kvstream_thread_up", "1 while a replica thread runs, 0 while it waits to restart", ["thread"], registry=r)
        self.fatal = Gauge("kvstream_fatal", "1 once the replica gave up (it exits non-zero)", registry=r)
        self.produce_refused = Counter(
            "kvstream_produce_refused", "Records the producer refused at once (too large, queue full), by purpose",
            ["what", "error"], registry=r,
        )
        self.dlq_referenced = Counter(
            "kvstream_dlq_referenced", "Records over the DLQ size bound, referenced (offset, size, digest) instead of copied",
            registry=r,
        )
        self.registry_records = Counter(
            "kvstream_registry_records", "Worker registrations and tombstones applied from kvstream.workers", registry=r
        )
        self.registry_skipped = Counter(
            "kvstream_registry_skipped",
            "Records of kvstream.workers skipped, by reason (bad_key, undecodable, invalid, wrong_key, "
            "unknown_tombstone)",
            ["reason"], registry=r,
        )
        self.registered_workers = Gauge("kvstream_registered_workers", "Workers in the registry", registry=r)
        self.stale = Gauge(
            "kvstream_index_stale",
            "1 while a live replica routes on an index it knows is behind (lag past ready_max_lag, or the "
            "broker unreachable)", registry=r,
        )
        self.broker_unreachable = Gauge(
            "kvstream_broker_unreachable", "1 while the broker does not answer the replica's offset queries", registry=r
        )
        self.stale_decisions = Counter(
            "kvstream_stale_decisions", "Routing decisions made on an index known to be behind (marked stale)", registry=r
        )
        self.partitions = Gauge("kvstream_events_partitions", "Partitions of the events topic being read", registry=r)
        self.worker_mode = Gauge(
            "kvstream_worker_mode",
            "1 for how each routable worker is routed: by its KV events (events), or by the blocks routed to it "
            "alone (approximate: it publishes no events, or they stopped)",
            ["worker", "mode"], registry=r,
        )
        self.worker_role = Gauge(
            "kvstream_worker_role",
            "1 for the role of each routable worker: both (whole requests), prefill or decode (one leg of a "
            "disaggregated request)",
            ["worker", "role"], registry=r,
        )
        self.expected_blocks = Gauge(
            "kvstream_expected_blocks", "Blocks expected on workers: routed there, not confirmed by their events yet",
            registry=r,
        )
        self.ttft_rate = Gauge(
            "kvstream_ttft_prefill_tokens_per_second",
            "The ttft policy's learned prefill throughput of the fleet (0: nothing observed yet)", registry=r,
        )
        self.ttft_error = Gauge(
            "kvstream_ttft_model_error",
            "The ttft policy's relative error: |observed - predicted| / predicted prefill time, token-weighted and "
            "decayed; costs closer than ttft_error_band times this are decided by the cache", registry=r,
        )
        self._last_commit: float | None = None
        self.snapshot_age.set_function(
            lambda: 0.0 if self._last_commit is None else time.time() - self._last_commit
        )

    def snapshot_committed(self, meta: SnapshotMeta, duration_s: float) -> None:
        self._last_commit = time.time()
        self.snapshot_duration.set(duration_s)
        self.snapshot_blocks.set(meta.blocks())

    def set_rejections(self, counters: dict[str, int]) -> None:
        for reason, n in counters.items():
            self.rejected.labels(reason=reason).set(n)
