"""The copy of a record the fold could not apply, for ``kvstream.dlq`` (DESIGN.md §7).

A copy carries the reason and where the original is (``kvstream-error``,
``kvstream-source``). A record larger than the replica's ``dlq_max_bytes``, or whose
headers cannot be read, is referenced instead of copied (where it is, its size and
SHA-256), so that the copy itself can never be refused for its size or its headers.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

ERROR_HEADER = "kvstream-error"
SOURCE_HEADER = "kvstream-source"
#: On a DLQ record that references a too-large original instead of copying it.
REF_HEADER = "kvstream-dlq-reference"
#: The longest reason written (a decoder's message can quote the record).
MAX_REASON_CHARS = 2000
#: The longest original key kept on a reference.
MAX_REF_KEY_BYTES = 1024


@dataclass(frozen=True, slots=True)
class DlqCopy:
    """What goes to the DLQ for one record."""

    value: bytes | None
    key: bytes | None
    headers: list[tuple[str, bytes]]
    #: True when the original is referenced, not copied.
    referenced: bool


def dlq_copy(m: Any, reason: str, *, by_reference: bool, max_bytes: int) -> DlqCopy:
    """The DLQ record of the consumed ``confluent_kafka.Message`` ``m``. Never raises."""
    value, key = m.value(), m.key()
    source = f"{m.topic()}/{m.partition()}/{m.offset()}"
    try:
        headers = list(m.headers() or [])
    except Exception:  # noqa: BLE001 - unreadable headers: reference the record
        headers, by_reference = [], True
    size = len(value or b"") + len(key or b"") + sum(len(k) + len(v or b"") for k, v in headers)
    referenced = by_reference or size > max_bytes
    if referenced:
        digest = hashlib.sha256(value or b"").hexdigest()
        value = json.dumps({
            "topic": m.topic(), "partition": m.partition(), "offset": m.offset(),
            "size": size, "sha256": digest, "reason": reason[:MAX_REASON_CHARS],
        }).encode()
        headers = [(REF_HEADER, f"size={size} sha256={digest}".encode())]
        key = key if key is not None and len(key) <= MAX_REF_KEY_BYTES else None
    headers += [(ERROR_HEADER, reason[:MAX_REASON_CHARS].encode()), (SOURCE_HEADER, source.encode())]
    return DlqCopy(value, key, headers, referenced)
