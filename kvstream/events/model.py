"""Router events (DESIGN.md §2): what a worker tells the routers about its blocks.

Hashes are plain Python ints in [0, 2**64): ``block_hashes`` are the worker's opaque
block identities (used only to find parents and removals), ``tokens_hashes`` are the
local hashes of each block's tokens (kvstream.hashing), which the router matches on.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from kvstream.events.errors import EventError, UnknownMediumError

U64_MAX = (1 << 64) - 1
#: Kafka header of an event batch: JSON ``{issue: count}`` of what the worker's engine
#: sent that could not be applied (e.g. ``block_size_mismatch``), for /v1/workers.
#: Advisory, outside the fold: only batches sent while such counts exist carry it.
STATUS_HEADER = "kvstream-worker-status"
#: Header that marks a log-clock tick: a record with no events that only advances its
#: partition's log time (replicas publish them to idle partitions; kvstream.replica.ticks).
TICK_HEADER = "kvstream-tick"


class Tier(str, Enum):
    """Where a block lives, fastest first."""

    DEVICE = "device"  # G1
    HOST_PINNED = "host_pinned"  # G2
    DISK = "disk"  # G3
    EXTERNAL = "external"  # G4 / remote


#: Lower tiers in the order in which they continue a device prefix match (DESIGN.md §4).
LOWER_TIERS: tuple[Tier, ...] = (Tier.HOST_PINNED, Tier.DISK, Tier.EXTERNAL)

_MEDIUM_TO_TIER: dict[str, Tier] = {
    "GPU": Tier.DEVICE,
    "DEVICE": Tier.DEVICE,
    "CPU": Tier.HOST_PINNED,
    "CPU_PINNED": Tier.HOST_PINNED,
    "CPU_TIER1": Tier.HOST_PINNED,
    "CPU_TIER2": Tier.DISK,
    "DISK": Tier.DISK,
    "NVME": Tier.DISK,
    "STORAGE": Tier.DISK,  # vLLM's file / object offloading tiers
    "EXTERNAL": Tier.EXTERNAL,
    "NETWORK": Tier.EXTERNAL,
    "REMOTE": Tier.EXTERNAL,
    "SHARED": Tier.EXTERNAL,
}


def tier_from_medium(medium: str | None) -> Tier:
    """Map an engine ``medium`` string to a tier; a missing medium means the device."""
    if medium is None:
        return Tier.DEVICE
    try:
        return _MEDIUM_TO_TIER[medium.upper()]
    except KeyError:
        raise UnknownMediumError(f"unknown storage medium {medium!r}") from None


@dataclass(frozen=True, slots=True)
class Stored:
    """Blocks stored on ``tier``, each the child of the previous one (the first one the
    child of ``parent_hash``, or a root block when it is None)."""

    worker_id: int
    dp_rank: int
    tier: Tier
    epoch: int
    event_id: int
    parent_hash: int | None
    block_hashes: tuple[int, ...]
    tokens_hashes: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.block_hashes) != len(self.tokens_hashes):
            raise EventError(
                f"stored event has {len(self.block_hashes)} block hashes "
                f"but {len(self.tokens_hashes)} tokens hashes"
            )
        if not self.block_hashes:
            raise EventError("stored event carries no blocks")


@dataclass(frozen=True, slots=True)
class Removed:
    """Blocks removed from ``tier``."""

    worker_id: int
    dp_rank: int
    tier: Tier
    epoch: int
    event_id: int
    block_hashes: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.block_hashes:
            raise EventError("removed event carries no blocks")


@dataclass(frozen=True, slots=True)
class Cleared:
    """Every block of rank ``dp_rank`` of the worker is gone from ``tier`` (the other
    ranks and tiers keep theirs). A new epoch, not this event, wipes every rank."""

    worker_id: int
    dp_rank: int
    tier: Tier
    epoch: int
    event_id: int


RouterEvent = Stored | Removed | Cleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    """One Kafka message: events of one worker incarnation (``epoch``), in order.

    An empty batch is a heartbeat. ``lease_ms`` is how long, in log time, the routers
    keep the worker after its last batch.
    """

    worker_id: int
    epoch: int
    lease_ms: int
    events: tuple[RouterEvent, ...]

    def __post_init__(self) -> None:
        for ev in self.events:
            if ev.worker_id != self.worker_id or ev.epoch != self.epoch:
                raise EventError(
                    f"event of worker {ev.worker_id} epoch {ev.epoch} in a batch of "
                    f"worker {self.worker_id} epoch {self.epoch}"
                )
