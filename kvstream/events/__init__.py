"""Router events (DESIGN.md §2), the vocabulary every package shares: ``model`` (the
events and their batch), ``codec`` (Avro single-object encoding), ``strict`` (Avro bodies
checked as the reference decoders check them), ``schemas`` (every schema version, from
``schemas/``), ``wire`` (u64 ids as Avro longs and as record keys), ``control`` (resync
requests on ``kvstream.control``), ``registration`` (a worker's record on
``kvstream.workers``), ``errors``."""

from kvstream.events.errors import DecodeError, EventError, UnknownMediumError
from kvstream.events.model import (
    LOWER_TIERS,
    Cleared,
    EventBatch,
    Removed,
    RouterEvent,
    Stored,
    Tier,
    tier_from_medium,
)

__all__ = [
    "LOWER_TIERS",
    "Cleared",
    "DecodeError",
    "EventBatch",
    "EventError",
    "Removed",
    "RouterEvent",
    "Stored",
    "Tier",
    "UnknownMediumError",
    "tier_from_medium",
]
