"""Router events → :class:`~kvstream.events.model.EventBatch` records (DESIGN.md §2): the
pure half of the publisher, shared with the simulator's in-memory log so that both cut
the same batches.

- Event ids are strictly increasing per (worker, dp_rank) within an epoch, from 1.
- A ``stored`` that continues the previous ``stored`` (same rank and tier, its parent is
  that event's last block) is merged into it, and so are consecutive ``removed``.
- A batch is cut when it holds ``max_events`` events or ``max_blocks`` blocks (a longer
  ``stored`` or ``removed`` is split in pieces that fit), or when the owner calls
  :meth:`EventBatcher.cut`; each batch goes to ``emit`` with its block count.

No I/O and no clock of its own: the owner decides when lingering batches go out.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from kvstream.events.model import Cleared, EventBatch, Removed, RouterEvent, Stored, Tier

#: Receives each batch cut and the number of block hashes in it.
BatchSink = Callable[[EventBatch, int], None]


class _Pending:
    """An event being built: merged with its successors until the batch is cut."""

    __slots__ = ("kind", "rank", "tier", "parent", "hashes", "tokens")

    def __init__(self, kind: type[RouterEvent], rank: int, tier: Tier, parent: int | None, hashes: list[int], tokens: list[int]) -> None:
        self.kind = kind
        self.rank = rank
        self.tier = tier
        self.parent = parent
        self.hashes = hashes
        self.tokens = tokens


class EventBatcher:
    """A :class:`~kvstream.worker.consolidator.RouterEventWriter` that stamps one worker's
    events (epoch, ids) and cuts them into batches for ``emit``."""

    def __init__(
        self,
        worker_id: int,
        lease_ms: int,
        max_events: int,
        max_blocks: int,
        emit: BatchSink,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.worker_id = worker_id
        self.lease_ms = lease_ms
        self._max_events = max_events
        self._max_blocks = max_blocks
        self._emit = emit
        self._clock = clock
        self.epoch = 0
        #: The next event id of each rank in this epoch.
        self.next_ids: dict[int, int] = {}
        self._pending: list[_Pending] = []
        self._pending_blocks = 0
        #: When the oldest pending event was written (``clock``).
        self.pending_since = 0.0

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    def start_epoch(self, epoch: int) -> None:
        """A new incarnation: ids start again from 1, and its first event is ``cleared``."""
        self.epoch = epoch
        self.next_ids = {}
        self.cleared(0)

    def resume(self, epoch: int, next_ids: Mapping[int, int]) -> None:
        """Go on with an incarnation where its last batch left it (no ``cleared``)."""
        self.epoch = epoch
        self.next_ids = dict(next_ids)

    def ranks(self) -> list[int]:
        """Every rank this epoch has written, sent or pending."""
        return sorted({*self.next_ids, *(p.rank for p in self._pending)})

    # ------------------------------------------------------------------ writer

    def stored(
        self,
        dp_rank: int,
        tier: Tier,
        parent_hash: int | None,
        block_hashes: list[int],
        tokens_hashes: list[int],
    ) -> None:
        cap = self._max_blocks
        for start in range(0, len(block_hashes), cap):
            # Pieces fit a batch; each continues the previous one, so they merge back
            # wherever there is room.
            piece_h = block_hashes[start : start + cap]
            last = self._pending[-1] if self._pending else None
            if (
                last is not None
                and last.kind is Stored
                and parent_hash is not None
                and last.rank == dp_rank
                and last.tier is tier
                and last.hashes[-1] == parent_hash
                and len(last.hashes) + len(piece_h) <= cap
            ):
                last.hashes.extend(piece_h)
                last.tokens.extend(tokens_hashes[start : start + cap])
            else:
                self._add(_Pending(Stored, dp_rank, tier, parent_hash, piece_h, tokens_hashes[start : start + cap]))
            self._pending_blocks += len(piece_h)
            parent_hash = piece_h[-1]
            self._maybe_cut()

    def removed(self, dp_rank: int, tier: Tier, block_hashes: list[int]) -> None:
        cap = self._max_blocks
        for start in range(0, len(block_hashes), cap):
            piece = block_hashes[start : start + cap]
            last = self._pending[-1] if self._pending else None
            if (
                last is not None
                and last.kind is Removed
                and last.rank == dp_rank
                and last.tier is tier
                and len(last.hashes) + len(piece) <= cap
            ):
                last.hashes.extend(piece)
            else:
                self._add(_Pending(Removed, dp_rank, tier, None, piece, []))
            self._pending_blocks += len(piece)
            self._maybe_cut()

    def cleared(self, dp_rank: int, tier: Tier = Tier.DEVICE) -> None:
        self._add(_Pending(Cleared, dp_rank, tier, None, [], []))
        self._maybe_cut()

    def _add(self, pending: _Pending) -> None:
        if not self._pending:
            self.pending_since = self._clock()
        self._pending.append(pending)

    def _maybe_cut(self) -> None:
        if len(self._pending) >= self._max_events or self._pending_blocks >= self._max_blocks:
            self.cut()

    # ------------------------------------------------------------------ batches

    def cut(self) -> None:
        """Turn the pending events into one batch for ``emit`` (nothing when none is)."""
        if not self._pending:
            return
        wid, epoch, next_id = self.worker_id, self.epoch, self.next_ids
        events: list[RouterEvent] = []
        for p in self._pending:
            eid = next_id.get(p.rank, 1)
            next_id[p.rank] = eid + 1
            if p.kind is Stored:
                events.append(Stored(wid, p.rank, p.tier, epoch, eid, p.parent, tuple(p.hashes), tuple(p.tokens)))
            elif p.kind is Removed:
                events.append(Removed(wid, p.rank, p.tier, epoch, eid, tuple(p.hashes)))
            else:
                events.append(Cleared(wid, p.rank, p.tier, epoch, eid))
        blocks = self._pending_blocks
        # Reset before emitting: a sink that raises (a full queue) loses this batch
        # whole, never half of it.
        self._pending = []
        self._pending_blocks = 0
        self._emit(EventBatch(wid, epoch, self.lease_ms, tuple(events)), blocks)

    def heartbeat(self) -> EventBatch:
        """An empty batch of this epoch (keeps the worker's lease)."""
        return EventBatch(self.worker_id, self.epoch, self.lease_ms, ())
