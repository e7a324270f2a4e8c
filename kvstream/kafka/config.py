"""librdkafka client configurations built from :class:`kvstream.settings.Settings`.

Order of precedence: kvstream's defaults < ``settings.kafka_options`` (passthrough for
security.protocol, SASL, SSL, tuning) < the caller's ``overrides``. Keys that kvstream's
correctness rests on cannot come from the passthrough. librdkafka keys contain dots, so
overrides are passed as ``producer_config(settings, **{"linger.ms": 1})``.
"""

from __future__ import annotations

import logging
import re
import threading
import time
import functools
import uuid
from typing import Any

from kvstream.kafka.errors import KafkaConfigError
from kvstream.kafka.local_broker import default_cluster_dir, local_bootstrap
from kvstream.settings import Settings

#: Set by kvstream itself; in ``kafka_options`` they would silently break delivery or replay.
OWNED_KEYS = frozenset(
    {
        "bootstrap.servers",
        "group.id",
        "enable.idempotence",
        "acks",
        "enable.auto.commit",
        "enable.auto.offset.store",
        "auto.offset.reset",
        "enable.partition.eof",
    }
)

PRODUCER_DEFAULTS: dict[str, Any] = {
    "enable.idempotence": True,
    "acks": "all",
    # Chosen with `kvstream bench publish --rate ... --producer-set ...` (docs/BENCHMARKS.md):
    # a steady worker sends a message every few ms, so at 5 ms each produce request
    # carried ~1.2 records; 10 ms gathers ~3, and zstd then shrinks the batch (lz4 barely
    # does: the hashes are random, only the framing compresses). Fewer bytes on the wire
    # per block event (a fifth for one-block events) for a few ms more event latency;
    # 20-50 ms saves a little more and costs as much more latency. The replicas' load
    # ops are paced instead (kvstream.replica.pacer).
    "compression.type": "zstd",
    "linger.ms": 10,
    "batch.size": 1024 * 1024,
    "batch.num.messages": 10_000,
    # Bound the client's buffer (librdkafka's default is 1 GB).
    "queue.buffering.max.kbytes": 256 * 1024,
    # Same key → partition mapping as the Java clients, so any client agrees where a
    # worker's events live.
    "partitioner": "murmur2_random",
}

CONSUMER_DEFAULTS: dict[str, Any] = {
    # A replica assigns partitions itself and keeps offsets in its snapshot (DESIGN.md §7):
    # nothing is committed automatically or read back (a replica commits its positions
    # explicitly, for lag tooling only: kvstream.replica.positions), and a missing
    # offset is an error, never a silent jump.
    "enable.auto.commit": False,
    "enable.auto.offset.store": False,
    "auto.offset.reset": "error",
    "enable.partition.eof": True,
}


def resolve_bootstrap(settings: Settings) -> str:
    """``settings.bootstrap``, else the running local development broker's."""
    if settings.bootstrap:
        return settings.bootstrap
    local = local_bootstrap()
    if local is None:
        raise KafkaConfigError(
            "no Kafka bootstrap: set KVSTREAM_BOOTSTRAP (or --bootstrap), or start the local "
            f"broker with `kvstream broker start` (none runs in {default_cluster_dir()})"
        )
    return local


#: A line of librdkafka's log of the same shape (digits aside: ports, client numbers,
#: timings) is shown at most once in this many seconds; an unreachable broker makes every
#: client repeat its connection failure several times a second.
CLIENT_LOG_REPEAT_S = 30.0


class _ClientLogHandler(logging.Handler):
    """librdkafka's log (the clients' ``logger``) through kvstream's structured log, with
    repeats of the same line folded into a count."""

    def __init__(self) -> None:
        super().__init__()
        self._last: dict[str, tuple[float, int]] = {}
        self._guard = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        from kvstream.logs import get_logger

        text = record.getMessage()
        shape = re.sub(r"\d+", "#", text)
        now = time.monotonic()
        with self._guard:
            last, folded = self._last.get(shape, (float("-inf"), 0))
            if now - last < CLIENT_LOG_REPEAT_S:
                self._last[shape] = (last, folded + 1)
                return
            self._last[shape] = (now, 0)
        extra = {"repeats_folded": folded} if folded else {}
        get_logger("librdkafka").log(max(record.levelno, logging.INFO), text, **extra)


_CLIENT_LOG = logging.getLogger("kvstream.kafka.client")
_CLIENT_LOG.addHandler(_ClientLogHandler())
_CLIENT_LOG.propagate = False


def _base(settings: Settings, client_id: str) -> dict[str, Any]:
    owned = sorted(OWNED_KEYS & settings.kafka_options.keys())
    if owned:
        raise KafkaConfigError(
            f"kafka_options may not set {', '.join(owned)}: kvstream sets "
            "these itself (use `bootstrap` for the servers)"
        )
    if settings.kafka_options:
        check_kafka_options(tuple(sorted(settings.kafka_options.items())))
    return {"bootstrap.servers": resolve_bootstrap(settings), "client.id": client_id, "logger": _CLIENT_LOG}


@functools.cache
def check_kafka_options(options: tuple[tuple[str, str], ...]) -> None:
    """librdkafka's own verdict on the passthrough options (an unknown key, a value it
    refuses), once per process: a KafkaConfigError that names the key, never a value
    (it may be a password), instead of a failure deep in the first client made."""
    import logging

    from confluent_kafka import KafkaException, Producer

    quiet = logging.getLogger("kvstream.kafka.options")
    quiet.disabled = True  # librdkafka's warnings about consumer-only keys and no brokers
    try:
        Producer(dict(options), logger=quiet)
    except KafkaException as exc:
        message = exc.args[0].str() if exc.args and hasattr(exc.args[0], "str") else str(exc)
        for key, value in options:
            # Any value may be a secret; a very short one is redacted only under a
            # secret's key (elsewhere it would garble the message's own words).
            if len(str(value)) >= 3 or any(w in key for w in ("password", "secret", "key", "token", "jaas")):
                message = message.replace(str(value), "***") if value else message
        raise KafkaConfigError(f"kafka_options: {message}") from None


def producer_config(settings: Settings, **overrides: Any) -> dict[str, Any]:
    """Idempotent, acks=all, zstd producer settings."""
    return {
        **_base(settings, "kvstream-producer"),
        **PRODUCER_DEFAULTS,
        **settings.kafka_options,
        **overrides,
    }


def new_replica_group_id() -> str:
    return f"kvstream-replica-{uuid.uuid4().hex}"


def consumer_config(
    settings: Settings, *, group_id: str | None = None, **overrides: Any
) -> dict[str, Any]:
    """Settings for a consumer that assigns its partitions itself: ``group_id`` defaults
    to a fresh ``kvstream-replica-<uuid>`` that nothing commits to."""
    return {
        **_base(settings, "kvstream-replica"),
        "group.id": group_id or new_replica_group_id(),
        **CONSUMER_DEFAULTS,
        **settings.kafka_options,
        **overrides,
    }


def admin_config(settings: Settings, **overrides: Any) -> dict[str, Any]:
    return {**_base(settings, "kvstream-admin"), **settings.kafka_options, **overrides}
