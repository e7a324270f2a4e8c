"""A record of ``kvstream.events`` as the fold sees it, read from a Kafka message by one
total function (:func:`read_record`) that every reader uses: replicas, ``kvstream
replay`` and the tests' reference fold.

Everything a record carries comes from a producer the replica does not control: key,
value, every header, timestamp, size. One of them that cannot be read must never stop
ingest (a record that raises is read again after every restart, by every replica, live
or fresh, until it leaves retention). So reading never raises: what is wrong is kept as
the record's ``problem``, which the fold counts (``record_bad_header``) and the replica
dead-letters by reference. Headers are advisory (the events are in the value), so a
record with a bad header still applies its events, and replicas and replay agree on it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from kvstream.events.model import STATUS_HEADER, TICK_HEADER

#: Largest worker-status header read (bytes): a worker's engine issues are a few short
#: strings; this also bounds nesting far below any parser's recursion limit.
STATUS_MAX_BYTES = 4096


@dataclass(frozen=True, slots=True)
class Record:
    """What the fold needs of one record, and what was wrong with it (``problem``)."""

    partition: int
    offset: int
    timestamp_ms: int
    key: bytes | None
    value: bytes | None
    is_tick: bool = False
    #: The worker's engine issues (STATUS_HEADER), when the record carries a valid one.
    status: Mapping[str, Any] | None = None
    #: Why a header could not be read; None when all is well.
    problem: str | None = None


def read_record(m: Any) -> Record:
    """The :class:`Record` of a consumed ``confluent_kafka.Message`` (one without an
    error). Never raises."""
    key = m.key()
    value = m.value()
    try:
        headers = m.headers()
    except Exception as exc:  # noqa: BLE001 - e.g. a header name that is not UTF-8
        return Record(m.partition(), m.offset(), m.timestamp()[1], key, value,
                      problem=f"headers unreadable: {type(exc).__name__}")
    is_tick, status, problem = read_headers(headers)
    return Record(m.partition(), m.offset(), m.timestamp()[1], key, value, is_tick, status, problem)


def read_headers(headers: Any) -> tuple[bool, Mapping[str, Any] | None, str | None]:
    """(is a tick, worker status, problem) of a record's headers. Unknown headers are
    ignored (Kafka tooling adds its own); kvstream's own must be well formed."""
    if not headers:
        return False, None, None
    is_tick = False
    status: Mapping[str, Any] | None = None
    seen_status = False
    for name, raw in headers:
        if name == TICK_HEADER:
            is_tick = True  # its value is never read (old ticks carry none)
        elif name == STATUS_HEADER:
            if seen_status:
                return is_tick, None, f"header {STATUS_HEADER} given more than once"
            seen_status = True
            status, problem = _status(raw)
            if problem is not None:
                return is_tick, None, f"header {STATUS_HEADER}: {problem}"
    return is_tick, status, None


def _status(raw: bytes | None) -> tuple[Mapping[str, Any] | None, str | None]:
    if raw is None:
        return None, "no value"
    if len(raw) > STATUS_MAX_BYTES:
        return None, f"{len(raw)} bytes > {STATUS_MAX_BYTES}"
    try:
        doc = orjson.loads(raw)  # bounded nesting: raises past 1024 levels
    except orjson.JSONDecodeError as exc:
        return None, f"not JSON ({exc})"
    if not isinstance(doc, dict):
        return None, f"a JSON {type(doc).__name__}, not an object"
    return doc, None
