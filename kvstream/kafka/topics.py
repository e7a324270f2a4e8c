"""The topics of DESIGN.md §2: created idempotently, verified when they already exist."""

from __future__ import annotations

import time
from dataclasses import dataclass

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic, ResourceType

from kvstream.kafka.config import admin_config
from kvstream.kafka.errors import TopicError, TopicMismatchError
from kvstream.logs import get_logger
from kvstream.settings import Settings, TopicSettings

log = get_logger(__name__)

#: Topic roles, in creation order; the full name is ``settings.topics.name(role)``.
ROLES = ("events", "active", "control", "dlq", "workers")


@dataclass(frozen=True)
class TopicSpec:
    name: str
    partitions: int
    replication_factor: int
    #: Topic configs kvstream sets, as Kafka spells them.
    config: dict[str, str]


@dataclass(frozen=True)
class TopicState:
    spec: TopicSpec
    exists: bool
    #: True when this call created the topic.
    created: bool
    partitions: int | None
    replication_factor: int | None
    #: Actual values of the configs in ``spec.config``.
    config: dict[str, str]

    @property
    def partition_mismatch(self) -> bool:
        return self.exists and self.partitions != self.spec.partitions

    @property
    def drift(self) -> dict[str, tuple[str | None, str]]:
        """Configs of an existing topic that differ from the spec: key → (actual, expected)."""
        if not self.exists:
            return {}
        return {
            k: (self.config.get(k), v) for k, v in self.spec.config.items() if self.config.get(k) != v
        }


def replication_factor(settings: Settings, brokers: int) -> int:
    """``settings.topics.replication_factor``, or min(3, brokers) when it is 0."""
    wanted = settings.topics.replication_factor or min(3, brokers)
    if wanted > brokers:
        raise TopicError(
            f"replication factor {wanted} needs at least {wanted} brokers; the cluster has {brokers}"
        )
    return wanted


def topic_specs(settings: Settings, brokers: int) -> list[TopicSpec]:
    t = settings.topics
    rf = replication_factor(settings, brokers)
    layout = {
        "events": (t.events_partitions, t.events_retention_ms),
        "active": (t.active_partitions, t.active_retention_ms),
        "control": (t.control_partitions, t.control_retention_ms),
        "dlq": (t.dlq_partitions, t.dlq_retention_ms),
    }
    specs = []
    for role in ROLES:
        if role == "workers":
            specs.append(TopicSpec(t.name(role), t.workers_partitions, rf, _workers_config(t, rf)))
            continue
        partitions, retention_ms = layout[role]
        config = {
            "cleanup.policy": "delete",
            "retention.ms": str(retention_ms),
            # Retention drops whole closed segments: roll well within the retention time,
            # or records outlive it by up to a segment's age (7 days by default).
            "segment.ms": str(max(60_000, retention_ms // 24)),
            # With three replicas, an acknowledged write survives the loss of one broker.
            "min.insync.replicas": "2" if rf >= 3 else "1",
        }
        if role == "events" and t.events_max_future_ms:
            # The fold's clocks are record timestamps (docs/RELIABILITY.md, threat model).
            config["message.timestamp.after.max.ms"] = str(t.events_max_future_ms)
        specs.append(TopicSpec(t.name(role), partitions, rf, config))
    return specs


def _workers_config(t: TopicSettings, rf: int) -> dict[str, str]:
    """The worker registry keeps each worker's last registration for ever (compaction),
    and a tombstone long enough for every replica to read it."""
    return {
        "cleanup.policy": "compact",
        "delete.retention.ms": str(t.workers_tombstone_retention_ms),
        # Compaction never touches the active segment: roll it daily so that superseded
        # registrations do go.
        "segment.ms": str(24 * 3600 * 1000),
        "min.insync.replicas": "2" if rf >= 3 else "1",
    }


def _admin(settings: Settings) -> AdminClient:
    return AdminClient(admin_config(settings))


def topic_id(settings: Settings, topic: str, *, timeout: float = 30.0) -> str | None:
    """The topic's id (a new one when a topic is deleted and recreated; tells two
    topics of the same name apart), or None when the broker does not say."""
    from confluent_kafka import TopicCollection

    admin = _admin(settings)  # held until the answer comes: a dropped client fails its futures
    try:
        desc = admin.describe_topics(TopicCollection([topic]), request_timeout=timeout)[topic].result()
    except KafkaException:
        return None
    tid = getattr(desc, "topic_id", None)
    return str(tid) if tid is not None else None


def _broker_count(admin: AdminClient, timeout: float) -> int:
    try:
        return len(admin.list_topics(timeout=timeout).brokers)
    except KafkaException as exc:
        raise TopicError(f"cannot reach Kafka: {exc.args[0]}") from exc


def _describe_configs(
    admin: AdminClient, names: list[str], deadline: float, timeout: float
) -> dict[str, dict[str, str]]:
    configs: dict[str, dict[str, str]] = {}
    todo = list(names)
    while todo:
        futures = admin.describe_configs(
            [ConfigResource(ResourceType.TOPIC, name) for name in todo], request_timeout=timeout
        )
        todo = []
        for resource, future in futures.items():
            try:
                entries = future.result(timeout=timeout)
            except KafkaException as exc:
                err = exc.args[0]
                # In a cluster, the broker asked may not know a just-created topic yet.
                if err.code() == KafkaError.UNKNOWN_TOPIC_OR_PART and time.monotonic() < deadline:
                    todo.append(resource.name)
                    continue
                raise TopicError(f"cannot describe {resource.name}: {err.str()}") from exc
            configs[resource.name] = {k: e.value for k, e in entries.items()}
        if todo:
            time.sleep(0.2)
    return configs


def _states(
    admin: AdminClient, specs: list[TopicSpec], created: set[str], timeout: float
) -> list[TopicState]:
    deadline = time.monotonic() + timeout
    # A just-created topic can take a moment to show all its partitions in metadata.
    while True:
        md = admin.list_topics(timeout=timeout)
        pending = [
            s.name
            for s in specs
            if s.name in created
            and (s.name not in md.topics or md.topics[s.name].error is not None
                 or len(md.topics[s.name].partitions) < s.partitions)
        ]
        if not pending or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    present = {s.name for s in specs if s.name in md.topics and md.topics[s.name].error is None}
    configs = _describe_configs(admin, sorted(present), deadline, timeout)
    states = []
    for s in specs:
        topic = md.topics.get(s.name)
        if s.name in present and topic is not None:
            first = next(iter(topic.partitions.values()), None)
            states.append(
                TopicState(
                    spec=s,
                    exists=True,
                    created=s.name in created,
                    partitions=len(topic.partitions),
                    replication_factor=len(first.replicas) if first else None,
                    config={k: configs[s.name][k] for k in s.config if k in configs[s.name]},
                )
            )
        else:
            states.append(TopicState(s, False, False, None, None, {}))
    return states


def describe_topics(settings: Settings, *, timeout: float = 30.0) -> list[TopicState]:
    """The state of every kvstream topic against the settings (nothing is changed)."""
    admin = _admin(settings)
    specs = topic_specs(settings, _broker_count(admin, timeout))
    return _states(admin, specs, set(), timeout)


def ensure_topics(settings: Settings, *, timeout: float = 30.0) -> list[TopicState]:
    """Create the missing kvstream topics; verify those that exist.

    Raises :class:`TopicMismatchError` if an existing topic has another partition count
    (the key → partition mapping, hence per-worker order, depends on it). Other config
    differences are logged, not changed: they may be an operator's choice.
    """
    admin = _admin(settings)
    specs = topic_specs(settings, _broker_count(admin, timeout))
    existing = admin.list_topics(timeout=timeout).topics
    missing = [s for s in specs if s.name not in existing]
    created: set[str] = set()
    if missing:
        futures = admin.create_topics(
            [NewTopic(s.name, s.partitions, s.replication_factor, config=s.config) for s in missing],
            request_timeout=timeout,
        )
        for name, future in futures.items():
            try:
                future.result(timeout=timeout)
                created.add(name)
            except KafkaException as exc:
                err = exc.args[0]
                # Another process created it meanwhile: verified below like any existing one.
                if err.code() != KafkaError.TOPIC_ALREADY_EXISTS:
                    raise TopicError(f"cannot create topic {name}: {err.str()}") from exc
    states = _states(admin, specs, created, timeout)
    absent = [st.spec.name for st in states if not st.exists]
    if absent:
        raise TopicError(f"topics not visible after creation: {', '.join(absent)}")
    mismatched = [st for st in states if st.partition_mismatch]
    if mismatched:
        raise TopicMismatchError(
            "; ".join(
                f"topic {st.spec.name} has {st.partitions} partitions, settings say "
                f"{st.spec.partitions}"
                for st in mismatched
            )
            + ". Changing the partition count moves workers to other partitions and breaks "
            "their order: fix topics.*_partitions in the settings or recreate the topic."
        )
    for st in states:
        if st.created:
            log.info("topic created", topic=st.spec.name, partitions=st.partitions)
        elif st.drift:
            log.warning("topic config differs from settings", topic=st.spec.name, drift=st.drift)
    return states
