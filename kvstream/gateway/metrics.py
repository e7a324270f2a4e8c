"""Prometheus metrics of the gateway, in the replica's registry (its ``/metrics``)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

#: Seconds: from a millisecond (the relay's own cost) to minutes (long generations).
_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_GAPS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        #: (metric, label values) → its child: ``labels()`` costs a lock and a tuple
        #: build each time, several per request; the label values are few (the
        #: directory's models and workers, statuses).
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        r = registry
        self.requests = Counter(
            "kvstream_gateway_requests", "OpenAI requests answered, by model, endpoint and status",
            ["model", "endpoint", "status"], registry=r,
        )
        self.ttft = Histogram(
            "kvstream_gateway_ttft_seconds", "Time to the first content chunk (streams) or the response, as the gateway sees it",
            ["model"], buckets=_LATENCY, registry=r,
        )
        self.itl = Histogram(
            "kvstream_gateway_inter_chunk_seconds", "Time between two chunks of a relayed stream (inter-token latency)",
            ["model"], buckets=_GAPS, registry=r,
        )
        self.e2e = Histogram(
            "kvstream_gateway_request_seconds", "Time from the request to the end of its response",
            ["model", "endpoint"], buckets=_LATENCY, registry=r,
        )
        self.selected = Counter(
            "kvstream_gateway_worker_selections", "Requests sent to each worker (retries included)", ["worker"], registry=r
        )
        self.retries = Counter(
            "kvstream_gateway_retries", "Requests sent again to another worker after a failure before the first byte, by reason",
            ["reason"], registry=r,
        )
        self.upstream_failures = Counter(
            "kvstream_gateway_upstream_failures", "Failed attempts on a worker (connect, timeout, 5xx, broken stream)",
            ["worker", "reason"], registry=r,
        )
        self.breaker_state = Gauge(
            "kvstream_gateway_breaker_state", "A worker's circuit breaker: 0 closed, 1 open, 2 half-open", ["worker"], registry=r
        )
        self.breaker_opened = Counter(
            "kvstream_gateway_breaker_opened", "Times a worker's breaker opened", ["worker"], registry=r
        )
        self.worker_up = Gauge(
            "kvstream_gateway_worker_up", "1 while a worker may take requests (breaker closed or trial free)", ["worker"], registry=r
        )
        self.inflight = Gauge("kvstream_gateway_inflight", "Requests being relayed by this replica", registry=r)
        self.queued = Gauge("kvstream_gateway_queued", "Requests waiting for one of max_inflight slots", registry=r)
        self.predicted_cached = Counter(
            "kvstream_gateway_predicted_cached_tokens",
            "Prompt tokens the router predicted cached on the chosen worker (summed), by whether the engine reported "
            "its own count (reported=\"true\": compare with kvstream_gateway_engine_cached_tokens)",
            ["model", "reported"], registry=r,
        )
        self.forgone_cached = Counter(
            "kvstream_gateway_forgone_cached_tokens",
            "Prompt tokens the router credited as cached on another candidate beyond the chosen one (summed): the "
            "cache given up for load",
            ["model"], registry=r,
        )
        self.engine_cached = Counter(
            "kvstream_gateway_engine_cached_tokens",
            "Prompt tokens the engine reported cached (usage.prompt_tokens_details.cached_tokens, summed)",
            ["model"], registry=r,
        )
        self.prompt_tokens = Counter(
            "kvstream_gateway_prompt_tokens", "Prompt tokens of relayed requests (the engine's usage when reported, else the gateway's count)",
            ["model"], registry=r,
        )

    def of(self, metric: Any, *values: str) -> Any:
        """``metric.labels(*values)``, cached."""
        key = (id(metric), values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*values)
        return child
