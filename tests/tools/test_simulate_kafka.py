"""``kvstream simulate`` through the real broker routes exactly as the in-memory log."""

from __future__ import annotations

import pytest

from kvstream.router import RouterConfig
from kvstream.settings import Settings
from kvstream.tools.simulate.engine import EngineConfig
from kvstream.tools.simulate.eventlog import EventLog, KafkaEventLog, MemoryEventLog
from kvstream.tools.simulate.report import summarize
from kvstream.tools.simulate.runner import SimClock, SimOptions, simulate
from kvstream.tools.simulate.workload import WorkloadOptions, generate
from kvstream.worker.consolidator import Mode


@pytest.mark.slow
@pytest.mark.kafka
def test_kafka_and_memory_logs_give_the_same_decisions(kafka_topics: Settings) -> None:
    reqs = generate(WorkloadOptions(seed=5, sessions=10, tokens_per_id=32))
    # A G1 too small for the workload: evictions, onboarding from G2, every event kind.
    options = SimOptions(workers=3, policy="kv", mode=Mode.PASSTHROUGH, seed=11,
                         engine=EngineConfig(device_blocks=120, host_blocks=600, disk_blocks=2000))

    def memory(config: RouterConfig, clock: SimClock, seed: int) -> EventLog:
        return MemoryEventLog(config, clock, seed)

    def kafka(config: RouterConfig, clock: SimClock, seed: int) -> EventLog:
        return KafkaEventLog(kafka_topics, config, clock, seed, replicas=2)

    in_memory = simulate(reqs, options, memory)
    through_kafka = simulate(reqs, options, kafka)
    assert through_kafka.decisions == in_memory.decisions
    assert len({w for _, w in in_memory.decisions}) > 1
    assert through_kafka.replicas_agree
    assert through_kafka.log.counters == {} == in_memory.log.counters
    # The in-memory log batches with the publisher's own batcher: the same records.
    assert (in_memory.log.records, in_memory.log.events) == (through_kafka.log.records, through_kafka.log.events)
    a, b = summarize(in_memory), summarize(through_kafka)
    for key in ("hit_rate", "hit_rate_host", "router_hit_rate_host", "ttft_p50_ms", "ttft_p99_ms"):
        assert a[key] == b[key], key
    assert a["router_hit_rate_host"] > 0  # the router did see G2 events
