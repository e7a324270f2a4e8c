"""Client configurations: what kvstream sets, what passes through, what is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
from confluent_kafka import Consumer, Producer

from kvstream.kafka.config import (
    admin_config,
    consumer_config,
    producer_config,
    resolve_bootstrap,
)
from kvstream.kafka.errors import KafkaConfigError, TopicError
from kvstream.kafka.topics import topic_specs
from kvstream.settings import Settings, TopicSettings

SECURITY = {"security.protocol": "SASL_SSL", "sasl.mechanism": "PLAIN"}


def test_producer_is_idempotent_acks_all_zstd() -> None:
    cfg = producer_config(Settings(bootstrap="h:1"))
    assert cfg["bootstrap.servers"] == "h:1"
    assert cfg["enable.idempotence"] is True
    assert cfg["acks"] == "all"
    assert cfg["compression.type"] == "zstd"
    assert 0 < cfg["linger.ms"] <= 20


def test_consumer_never_commits_and_has_a_unique_group() -> None:
    settings = Settings(bootstrap="h:1")
    a, b = consumer_config(settings), consumer_config(settings)
    assert a["group.id"].startswith("kvstream-replica-")
    assert a["group.id"] != b["group.id"]
    assert a["enable.auto.commit"] is False
    assert a["auto.offset.reset"] == "error"
    assert a["enable.partition.eof"] is True
    assert consumer_config(settings, group_id="fixed")["group.id"] == "fixed"


def test_passthrough_reaches_every_client_and_overrides_win() -> None:
    settings = Settings(bootstrap="h:1", kafka_options=SECURITY | {"linger.ms": "50"})
    for cfg in (producer_config(settings), consumer_config(settings), admin_config(settings)):
        assert SECURITY.items() <= cfg.items()
    assert producer_config(settings)["linger.ms"] == "50"
    assert producer_config(settings, **{"linger.ms": 1})["linger.ms"] == 1


@pytest.mark.parametrize("key", ["bootstrap.servers", "group.id", "enable.idempotence", "acks"])
def test_passthrough_cannot_override_what_kvstream_owns(key: str) -> None:
    settings = Settings(bootstrap="h:1", kafka_options={key: "x"})
    with pytest.raises(KafkaConfigError, match=key):
        producer_config(settings)


def test_librdkafka_accepts_the_configs() -> None:
    # Unknown or misspelt property names make the constructors raise.
    settings = Settings(bootstrap="127.0.0.1:9")
    Producer(producer_config(settings))
    Consumer(consumer_config(settings)).close()


def test_bootstrap_falls_back_to_the_local_broker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVSTREAM_BROKER_DIR", str(tmp_path / "broker"))
    with pytest.raises(KafkaConfigError, match="kvstream broker start"):
        resolve_bootstrap(Settings(bootstrap=None))
    # A bootstrap file left by nodes that were killed, not stopped, is not trusted.
    (tmp_path / "broker").mkdir()
    (tmp_path / "broker" / "bootstrap").write_text("127.0.0.1:1234\n")
    with pytest.raises(KafkaConfigError, match="kvstream broker start"):
        resolve_bootstrap(Settings(bootstrap=None))
    assert resolve_bootstrap(Settings(bootstrap="x:1")) == "x:1"


@pytest.mark.parametrize(("brokers", "rf", "min_isr"), [(1, 1, "1"), (3, 3, "2"), (5, 3, "2")])
def test_replication_follows_the_cluster_size(brokers: int, rf: int, min_isr: str) -> None:
    specs = topic_specs(Settings(bootstrap="h:1"), brokers)
    assert [s.name for s in specs] == [
        "kvstream.events", "kvstream.active", "kvstream.control", "kvstream.dlq", "kvstream.workers"
    ]
    for spec in specs:
        assert spec.replication_factor == rf
        assert spec.config["min.insync.replicas"] == min_isr
        if spec.name == "kvstream.workers":
            assert spec.config["cleanup.policy"] == "compact"
            continue
        assert spec.config["cleanup.policy"] == "delete"
        # Segments roll well within the retention, so that retention can drop them.
        assert int(spec.config["segment.ms"]) < int(spec.config["retention.ms"])


def test_replication_factor_above_the_cluster_size_is_refused() -> None:
    settings = Settings(bootstrap="h:1", topics=TopicSettings(replication_factor=3))
    with pytest.raises(TopicError, match="needs at least 3 brokers"):
        topic_specs(settings, 1)
