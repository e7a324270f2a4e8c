"""The engine's ``/metrics``: vLLM 0.33's names, labels (``model_name``, ``engine``) and
TTFT / end-to-end latency buckets (vllm/v1/metrics/loggers.py and buckets.py)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0, 7680.0)


class EngineMetrics:
    """One engine's (DP rank's) series, labelled ``engine="<rank>"`` as vLLM labels each
    engine's, in its own registry (:func:`exposition` shows a server's ranks together)."""

    def __init__(self, model: str, engine: int = 0) -> None:
        self.registry = CollectorRegistry()
        labels = ("model_name", "engine")
        values = (model, str(engine))
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r).labels(*values)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r).labels(*values)

        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_queries = counter("vllm:prefix_cache_queries",
                                      "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.external_queries = counter("vllm:external_prefix_cache_queries",
                                        "External prefix cache queries from KV connector cross-instance cache "
                                        "sharing, in terms of number of queried tokens.")
        self.external_hits = counter("vllm:external_prefix_cache_hits",
                                     "External prefix cache hits from KV connector cross-instance cache sharing, "
                                     "in terms of number of cached tokens.")
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        # Not a vLLM series (vLLM counts a transfer only as external prefix cache hits):
        # the prompt tokens a disaggregated decode leg received instead of computing.
        self.kv_received = counter("kvstream_emulator_kv_transfer_received_tokens",
                                   "Prompt tokens whose KV was received from a prefill engine.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self._success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                (*labels, "finished_reason"), registry=r)
        self.success_length = self._success.labels(*values, "length")
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              labels, buckets=_TTFT_BUCKETS, registry=r).labels(*values)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             labels, buckets=_E2E_BUCKETS, registry=r).labels(*values)


class _Ranks:
    """The ranks' registries as one collector: each family once, with every rank's
    samples (the text format names a family once; vLLM's logger has one family per
    series, a label set per engine)."""

    def __init__(self, metrics: Sequence[EngineMetrics]) -> None:
        self.metrics = metrics

    def collect(self) -> Iterable[Metric]:
        families: dict[str, Metric] = {}
        for m in self.metrics:
            for family in m.registry.collect():  # fresh objects every collect
                if family.name in families:
                    families[family.name].samples += family.samples
                else:
                    families[family.name] = family
        return families.values()


def exposition(metrics: Sequence[EngineMetrics]) -> bytes:
    """``/metrics`` of a server's ranks (Prometheus' text format)."""
    return generate_latest(_Ranks(metrics))
