"""The reference of the fold's event digest, in Python over the model events: the
compiled reader (kvstream._native.EventBatchReader) computes it for each event it reads
(CPython's tuple and int hash, recomputed in Rust), and the fold keeps it (in snapshots
too), so it must be the same in every process and every version."""

from __future__ import annotations

from kvstream.events.codec import PACKED_TIERS
from kvstream.events.model import RouterEvent, Stored, Removed

_TIER_INDEX = {t: i for i, t in enumerate(PACKED_TIERS)}
#: What stands in for a missing parent (``hash(None)`` differs between processes, as does
#: an enum's: a tier stands as its index in PACKED_TIERS).
_NO_PARENT = -1


def event_digest(ev: RouterEvent) -> int:
    """``hash`` of the tuple of the event's fields, with the stand-ins above."""
    head = (ev.worker_id, ev.dp_rank, _TIER_INDEX[ev.tier], ev.epoch, ev.event_id)
    kind = type(ev)
    if kind is Stored:
        parent = _NO_PARENT if ev.parent_hash is None else ev.parent_hash
        return hash((*head, parent, ev.block_hashes, ev.tokens_hashes))
    if kind is Removed:
        return hash((*head, ev.block_hashes))
    return hash(head)
