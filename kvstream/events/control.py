"""Records of ``kvstream.control``: a replica's request that a worker resync.

A replica writes one when the log cannot tell it what a worker holds (a gap in its
event ids, a stale or moved epoch, a log whose start retention deleted); the worker's
publisher answers with ``cleared`` and its full state under an epoch above
``above_epoch``. Readers skip control records of other kinds.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvstream.events.wire import to_long, to_u64

RESYNC_REQUEST = "kvstream.control.ResyncRequest"
#: The longest ``reason`` a replica writes (a fold's reason can quote a record).
MAX_REASON_CHARS = 500


@dataclass(frozen=True, slots=True)
class ResyncRequest:
    """Asks ``worker_id`` (None: every worker) to republish its full state."""

    worker_id: int | None
    requester: str
    reason: str
    requested_at_ms: int
    #: The epoch the log holds for the worker (None: unknown); the new epoch must be
    #: greater: a plausible epoch forged ahead of the worker's own is outranked so.
    above_epoch: int | None = None

    def to_record(self) -> dict[str, Any]:
        """The Avro record of :data:`RESYNC_REQUEST`."""
        return {
            "worker_id": None if self.worker_id is None else to_long(self.worker_id, "worker_id"),
            "requester": self.requester,
            "reason": self.reason,
            "requested_at_ms": self.requested_at_ms,
            "above_epoch": None if self.above_epoch is None else to_long(self.above_epoch, "above_epoch"),
        }

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> ResyncRequest:
        wid, above = record["worker_id"], record.get("above_epoch")
        return cls(
            worker_id=None if wid is None else to_u64(wid),
            requester=record["requester"],
            reason=record["reason"],
            requested_at_ms=record["requested_at_ms"],
            above_epoch=None if above is None else to_u64(above),
        )
