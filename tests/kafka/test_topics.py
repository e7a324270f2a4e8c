"""Topic creation against the real broker: right configs, idempotent, mismatches refused."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from confluent_kafka.admin import AdminClient, ConfigResource, ResourceType

from kvstream.kafka.config import admin_config
from kvstream.kafka.errors import TopicError, TopicMismatchError
from kvstream.kafka.topics import describe_topics, ensure_topics
from kvstream.settings import Settings

pytestmark = pytest.mark.kafka


def _actual(settings: Settings, name: str) -> tuple[int, dict[str, str]]:
    """Partition count and configs of a topic, read straight from the broker."""
    admin = AdminClient(admin_config(settings))
    partitions = len(admin.list_topics(name, timeout=30).topics[name].partitions)
    future = admin.describe_configs([ConfigResource(ResourceType.TOPIC, name)])
    entries = next(iter(future.values())).result(timeout=30)
    return partitions, {k: e.value for k, e in entries.items()}


def test_create_is_idempotent_with_the_right_configs(
    kafka_topics_factory: Callable[..., Settings],
) -> None:
    settings = kafka_topics_factory(
        create=False, events_partitions=6, events_retention_ms=2 * 3600 * 1000
    )
    assert not any(st.exists for st in describe_topics(settings))

    first = ensure_topics(settings)
    assert [st.created for st in first] == [True] * 5

    partitions, config = _actual(settings, settings.topics.name("events"))
    assert partitions == 6
    assert config["retention.ms"] == str(2 * 3600 * 1000)
    assert config["cleanup.policy"] == "delete"
    partitions, config = _actual(settings, settings.topics.name("dlq"))
    assert partitions == 1
    assert config["retention.ms"] == str(settings.topics.dlq_retention_ms)
    # The worker registry keeps each worker's last registration: compacted, not deleted.
    partitions, config = _actual(settings, settings.topics.name("workers"))
    assert partitions == 1
    assert config["cleanup.policy"] == "compact"
    assert config["delete.retention.ms"] == str(settings.topics.workers_tombstone_retention_ms)

    second = ensure_topics(settings)
    assert [st.created for st in second] == [False] * 5
    assert all(st.exists and not st.drift for st in second)
    assert [st.partitions for st in second] == [6, 1, 1, 1, 1]


def test_partition_mismatch_is_an_error_and_changes_nothing(
    kafka_topics_factory: Callable[..., Settings],
) -> None:
    settings = kafka_topics_factory(events_partitions=4)
    wrong = settings.model_copy(
        update={"topics": settings.topics.model_copy(update={"events_partitions": 8})}
    )
    with pytest.raises(TopicMismatchError, match="has 4 partitions, settings say 8"):
        ensure_topics(wrong)
    assert _actual(settings, settings.topics.name("events"))[0] == 4
    events = describe_topics(wrong)[0]
    assert events.partition_mismatch


def test_replication_beyond_the_cluster_creates_nothing(
    kafka_topics_factory: Callable[..., Settings], kafka_bootstrap: str
) -> None:
    brokers = len(AdminClient({"bootstrap.servers": kafka_bootstrap}).list_topics(timeout=30).brokers)
    settings = kafka_topics_factory(create=False, replication_factor=brokers + 1)
    with pytest.raises(TopicError, match="brokers"):
        ensure_topics(settings)
    ok = settings.model_copy(
        update={"topics": settings.topics.model_copy(update={"replication_factor": 0})}
    )
    assert not any(st.exists for st in describe_topics(ok))
