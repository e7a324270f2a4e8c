"""Per-source block events: what one cache (G1 engine, G2 host, G3 disk) reports.

A source names its blocks by its own opaque hashes (an engine's block hashes, or the
tiered pool's sequence hashes); the consolidator maps them to router sequence hashes
through ``tokens_hashes`` (local hashes computed from token ids by the reporter).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from kvstream.events.model import Tier


@dataclass(frozen=True, slots=True)
class SourceStored:
    """``source`` now holds these blocks, each the child of the previous one; the first
    is the child of the block the source calls ``parent_hash`` (None: a root block)."""

    source: Tier
    dp_rank: int
    parent_hash: int | None
    block_hashes: tuple[int, ...]
    tokens_hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class SourceRemoved:
    """``source`` dropped these blocks (by the source's own hashes)."""

    source: Tier
    dp_rank: int
    block_hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class SourceCleared:
    """``source`` dropped every block it held."""

    source: Tier
    dp_rank: int


SourceEvent = SourceStored | SourceRemoved | SourceCleared


class SourceEventSink(Protocol):
    """Receives source events in the order the source produced them."""

    def on_source_event(self, event: SourceEvent) -> None: ...
