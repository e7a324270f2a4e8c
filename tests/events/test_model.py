"""The event model's own rules (DESIGN.md §2)."""

from __future__ import annotations

import dataclasses

import pytest

from kvstream.events.errors import EventError, UnknownMediumError
from kvstream.events.model import LOWER_TIERS, Cleared, EventBatch, Removed, Stored, Tier, tier_from_medium

MEDIA = {
    "GPU": Tier.DEVICE,
    "DEVICE": Tier.DEVICE,
    "CPU": Tier.HOST_PINNED,
    "CPU_PINNED": Tier.HOST_PINNED,
    "CPU_TIER1": Tier.HOST_PINNED,
    "CPU_TIER2": Tier.DISK,
    "DISK": Tier.DISK,
    "NVME": Tier.DISK,
    "EXTERNAL": Tier.EXTERNAL,
    "NETWORK": Tier.EXTERNAL,
    "REMOTE": Tier.EXTERNAL,
    "SHARED": Tier.EXTERNAL,
}


@pytest.mark.parametrize("medium", list(MEDIA))
def test_medium_to_tier(medium: str) -> None:
    assert tier_from_medium(medium) is MEDIA[medium]
    assert tier_from_medium(medium.lower()) is MEDIA[medium]


def test_missing_medium_is_device_and_unknown_is_an_error() -> None:
    assert tier_from_medium(None) is Tier.DEVICE
    with pytest.raises(UnknownMediumError, match="HBM3"):
        tier_from_medium("HBM3")


def test_lower_tier_order() -> None:
    assert LOWER_TIERS == (Tier.HOST_PINNED, Tier.DISK, Tier.EXTERNAL)


def test_stored_needs_one_tokens_hash_per_block() -> None:
    with pytest.raises(EventError, match="2 block hashes but 1 tokens hashes"):
        Stored(1, 0, Tier.DEVICE, 0, 0, None, (1, 2), (3,))
    with pytest.raises(EventError, match="no blocks"):
        Stored(1, 0, Tier.DEVICE, 0, 0, None, (), ())
    with pytest.raises(EventError, match="no blocks"):
        Removed(1, 0, Tier.DEVICE, 0, 0, ())


def test_batch_holds_only_its_worker_and_epoch() -> None:
    EventBatch(1, 2, 0, (Cleared(1, 0, Tier.DEVICE, 2, 0),))
    with pytest.raises(EventError, match="worker 3"):
        EventBatch(1, 2, 0, (Cleared(3, 0, Tier.DEVICE, 2, 0),))
    with pytest.raises(EventError, match="epoch 5"):
        EventBatch(1, 2, 0, (Cleared(1, 0, Tier.DEVICE, 5, 0),))


def test_events_are_immutable() -> None:
    ev = Cleared(1, 0, Tier.DEVICE, 2, 0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ev.event_id = 5  # type: ignore[misc]
