"""Router events: the model (``model``), its Avro wire codec (``codec``) and schemas,
how ids travel (``wire``) and the control records (``control``)."""

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
