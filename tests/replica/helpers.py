"""Building event batches and folds for the replica tests."""

from __future__ import annotations

import random

from kvstream.events.codec import EventCodec
from kvstream.events.model import Cleared, EventBatch, Removed, RouterEvent, Stored, Tier
from kvstream.hashing import block_hashes
from kvstream.replica.fold import LogFold
from kvstream.router import Router

CODEC = EventCodec()
LEASE_MS = 10_000


def new_fold() -> LogFold:
    return LogFold(Router(), CODEC)


class FakeWorkerLog:
    """Writes the records a well-behaved worker would publish (one epoch, increasing
    ids), as encoded bytes, so tests can also break them on purpose."""

    def __init__(self, worker_id: int, epoch: int = 1, ranks: int = 1, lease_ms: int = LEASE_MS) -> None:
        self.worker_id = worker_id
        self.epoch = epoch
        self.lease_ms = lease_ms
        self.next_id = {r: 0 for r in range(ranks)}

    def _id(self, rank: int) -> int:
        i = self.next_id[rank]
        self.next_id[rank] = i + 1
        return i

    def cleared(self, rank: int = 0, tier: Tier = Tier.DEVICE) -> Cleared:
        return Cleared(self.worker_id, rank, tier, self.epoch, self._id(rank))

    def stored(self, tokens: list[int], rank: int = 0, tier: Tier = Tier.DEVICE, start_block: int = 0) -> Stored:
        local, seq = block_hashes(tokens)
        parent = seq[start_block - 1] if start_block else None
        return Stored(
            self.worker_id, rank, tier, self.epoch, self._id(rank), parent,
            tuple(seq[start_block:]), tuple(local[start_block:]),
        )

    def removed(self, tokens: list[int], rank: int = 0, tier: Tier = Tier.DEVICE, start_block: int = 0) -> Removed:
        _, seq = block_hashes(tokens)
        return Removed(self.worker_id, rank, tier, self.epoch, self._id(rank), tuple(seq[start_block:]))

    def batch(self, *events: RouterEvent) -> bytes:
        return CODEC.encode(EventBatch(self.worker_id, self.epoch, self.lease_ms, tuple(events)))


def prompt(rng: random.Random, shared: list[int], blocks: int) -> list[int]:
    return shared + [rng.randrange(50_000) for _ in range(16 * blocks)]
