"""A request's life on the tiered pool, as an inference engine lives it (DESIGN.md §8):
one implementation for the synthetic worker and the simulator.

1. admitted: its cached prefix onboarded (G1, then G2, then G3) and pinned on G1;
2. allocated: G1 slots for the blocks still to compute;
3. prefilled: those blocks (their bytes written by the caller, if any) registered on G1
   under their hashes, pinned;
4. released when the request ends: the whole prompt unpinned, its blocks stay cached.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvstream.worker.onboard import Onboarder, OnboardResult
from kvstream.worker.pool import NewBlock


class PoolRequest:
    """One prompt's blocks on a pool: ``local`` and ``seq`` are its local and sequence
    hashes (:func:`kvstream.hashing.block_hashes`). Construction admits it."""

    def __init__(self, onboarder: Onboarder, local: Sequence[int], seq: Sequence[int], priority: int = 0) -> None:
        self.pool = onboarder.pool
        self.local = local
        self.seq = seq
        self.priority = priority
        #: The prefix found on some tier, now pinned on G1.
        self.found: OnboardResult = onboarder.onboard(seq, priority)
        #: G1 slots of the blocks to compute, in prompt order (after :meth:`allocate`).
        self.slots: list[int] = []

    @property
    def first_computed(self) -> int:
        """Index of the prompt's first block not found cached."""
        return len(self.found.block_hashes)

    def allocate(self, allocate: Callable[[int], list[int]] | None = None) -> list[int]:
        """G1 slots for the blocks to compute; ``allocate`` (default: the device tier's)
        may make room first. On failure the admitted prefix stays pinned (see
        :meth:`abort`)."""
        n = len(self.seq) - self.first_computed
        self.slots = (allocate or self.pool.device.allocate)(n)
        return self.slots

    def computed(self) -> zip[tuple[int, int]]:
        """(G1 slot, block index in the prompt) of each block to compute."""
        return zip(self.slots, range(self.first_computed, len(self.seq)))

    def prefilled(self) -> None:
        """The computed blocks are filled: register them on G1, pinned for the request."""
        seq, local = self.seq, self.local
        self.pool.device.register(
            [NewBlock(slot, seq[i], seq[i - 1] if i else None, local[i]) for slot, i in self.computed()],
            priority=self.priority,
            pin=True,
        )

    def abort(self) -> None:
        """The request failed before it was prefilled: unpin the admitted prefix."""
        self.pool.device.unpin(self.found.block_hashes)

    def release(self) -> None:
        """The request ended: its whole prompt is unpinned (and stays cached)."""
        self.pool.device.unpin(self.seq)
