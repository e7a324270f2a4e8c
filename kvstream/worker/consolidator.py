"""Consolidator (DESIGN.md §3): per-source block events in, router events out.

One block can sit in G1 (engine events) and in G2/G3 (offload events) at once, under
different source hashes. The consolidator keys every block by its router sequence hash
(``seq = chain(parent seq, local)``, recomputed from ``tokens_hashes``) and tracks which
sources hold it, per data-parallel rank.

- ``dedup`` (default): ``stored`` on the first source only, always tier device, under the
  hash that first source gave it; ``removed`` when the last source drops it. Children
  stored later through another source name their parent by that first-seen hash.
- ``passthrough``: every store/remove is forwarded with the source's own tier and hashes.

Input that cannot be applied is counted in :attr:`Consolidator.anomalies` by reason
(:class:`Anomaly`) and logged; it never raises and never half-applies an event.
Not thread-safe: one thread feeds it (the worker loop serializes the sources).
"""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

import msgpack

from kvstream.events.model import Tier
from kvstream.hashing import sequence_hashes
from kvstream.logs import get_logger
from kvstream.worker.options import Mode
from kvstream.worker.source_events import (
    SourceCleared,
    SourceEvent,
    SourceRemoved,
    SourceStored,
)

log = get_logger(__name__)


class Anomaly(str, Enum):
    """Why (part of) a source event was not applied."""

    #: Stored event with no blocks, lists of different lengths, or a hash repeated
    #: within the event (or equal to its parent): rejected whole.
    MALFORMED = "malformed"
    #: Stored event whose parent the source does not hold: rejected whole, since the
    #: sequence hashes of its blocks cannot be computed.
    UNKNOWN_PARENT = "unknown_parent"
    #: Stored event reusing a source hash (or, in dedup, a published hash) that already
    #: names a different block: rejected whole.
    HASH_CONFLICT = "hash_conflict"
    #: The source removes a block it does not hold: that hash is skipped.
    UNKNOWN_REMOVE = "unknown_remove"
    #: On replay, a block whose parent is no longer held cannot be expressed as a valid
    #: store (the router would reject it), so it is left out.
    REPLAY_ORPHAN = "replay_orphan"


class RouterEventWriter(Protocol):
    """Receives router events without worker id, epoch or event id (the publisher
    stamps those). Lists passed in are owned by the writer afterwards."""

    def stored(
        self,
        dp_rank: int,
        tier: Tier,
        parent_hash: int | None,
        block_hashes: list[int],
        tokens_hashes: list[int],
    ) -> None: ...

    def removed(self, dp_rank: int, tier: Tier, block_hashes: list[int]) -> None: ...

    def cleared(self, dp_rank: int, tier: Tier = Tier.DEVICE) -> None: ...


class StateSource(Protocol):
    """Something that can describe everything it holds as ``stored`` events."""

    def replay(self, writer: RouterEventWriter) -> None: ...


def _pack_rank(st: _RankState) -> bytes:
    seqs = list(st.blocks)
    vals = st.blocks.values()
    return msgpack.packb(
        {
            "seq": array("Q", seqs).tobytes(),
            "root": bytes(b[_PARENT] is None for b in vals),
            "parent": array("Q", [b[_PARENT] or 0 for b in vals]).tobytes(),
            "tokens": array("Q", [b[_TOKENS] for b in vals]).tobytes(),
            "first": array("Q", [b[_FIRST] for b in vals]).tobytes(),
            # Insertion order kept: a clear drops a source's blocks newest first.
            "sources": {t.value: (array("Q", m).tobytes(), array("Q", m.values()).tobytes()) for t, m in st.sources.items()},
        }
    )


def _unpack_rank(data: bytes, dedup: bool) -> _RankState:
    def q(b: bytes) -> list[int]:
        a = array("Q")
        a.frombytes(b)
        return a.tolist()

    d = msgpack.unpackb(data)
    parents = [None if root else p for root, p in zip(d["root"], q(d["parent"]))]
    st = _RankState()
    st.blocks = dict(zip(q(d["seq"]), zip(parents, q(d["tokens"]), q(d["first"]))))
    for tier, (hashes, seqs) in d["sources"].items():
        src, mine = st.source(Tier(tier))
        src.update(zip(q(hashes), q(seqs)))
        mine.update(zip(q(seqs), q(hashes)))
    if dedup:
        st.first = {b[_FIRST]: s for s, b in st.blocks.items()}
    return st


# A block of one rank, keyed by its sequence hash, is the plain tuple
# (parent sequence hash or None, tokens hash, first-seen hash): built by zip() on the hot
# path, where a class or a per-block dict of holders costs several times more. Who
# holds a block is kept per source instead (``_RankState.held``).
_Block = tuple[int | None, int, int]
_PARENT, _TOKENS, _FIRST = 0, 1, 2


@dataclass(slots=True)
class _RankState:
    #: sequence hash → (parent sequence hash, tokens hash, first-seen hash).
    blocks: dict[int, _Block] = field(default_factory=dict)
    #: source tier → (source hash → sequence hash), in insertion order.
    sources: dict[Tier, dict[int, int]] = field(default_factory=dict)
    #: source tier → (sequence hash → source hash): the same pairs, the other way.
    held: dict[Tier, dict[int, int]] = field(default_factory=dict)
    #: dedup only: published (first-seen) hash → sequence hash, to refuse collisions.
    first: dict[int, int] = field(default_factory=dict)

    def source(self, tier: Tier) -> tuple[dict[int, int], dict[int, int]]:
        """(hash → seq, seq → hash) of one source, created empty when new."""
        src = self.sources.get(tier)
        if src is None:
            src = self.sources[tier] = {}
            self.held[tier] = {}
        return src, self.held[tier]


class Consolidator:
    """A :class:`~kvstream.worker.source_events.SourceEventSink` that writes router
    events to ``writer`` and can replay its whole state (:class:`StateSource`)."""

    def __init__(self, writer: RouterEventWriter, mode: Mode = Mode.DEDUP) -> None:
        self._writer = writer
        self.mode = Mode(mode)
        self._dedup = self.mode is Mode.DEDUP
        self._ranks: dict[int, _RankState] = {}
        #: Count of rejected/skipped input by reason.
        self.anomalies: Counter[Anomaly] = Counter()
        #: Blocks a source stored again while holding them (an engine re-announcing its
        #: cached prefixes, e.g. vLLM's kv_cache_report_mode="full"): normal, not applied.
        self.reannounced: Counter[Tier] = Counter()

    # ------------------------------------------------------------------ queries

    def block_count(self, dp_rank: int | None = None) -> int:
        """Distinct blocks held by any source (on one rank, or on all)."""
        if dp_rank is not None:
            st = self._ranks.get(dp_rank)
            return len(st.blocks) if st else 0
        # list(): a metrics scrape may run this from another thread while ranks appear.
        return sum(len(st.blocks) for st in list(self._ranks.values()))

    def holders(self, dp_rank: int, seq_hash: int) -> dict[Tier, int]:
        """Sources holding the block with router sequence hash ``seq_hash`` (tier →
        the source's hash for it); empty when none holds it."""
        st = self._ranks.get(dp_rank)
        if st is None:
            return {}
        return {tier: m[seq_hash] for tier, m in st.held.items() if seq_hash in m}

    # ------------------------------------------------------------------ input

    def on_source_event(self, event: SourceEvent) -> None:
        if isinstance(event, SourceStored):
            self._stored(event)
        elif isinstance(event, SourceRemoved):
            self._removed(event)
        elif isinstance(event, SourceCleared):
            self._cleared(event)
        else:
            self._anomaly(Anomaly.MALFORMED, f"not a source event: {type(event).__name__}")

    def _anomaly(self, reason: Anomaly, detail: str, count: int = 1) -> None:
        first = reason not in self.anomalies
        self.anomalies[reason] += count
        # Warn on the first of each kind so operators notice; the rest go to debug and
        # the counters (exported as metrics), to keep a noisy engine from flooding logs.
        (log.warning if first else log.debug)("consolidator_anomaly", reason=reason.value, detail=detail)

    def _rank(self, dp_rank: int) -> _RankState:
        st = self._ranks.get(dp_rank)
        if st is None:
            st = self._ranks[dp_rank] = _RankState()
        return st

    def _stored(self, ev: SourceStored) -> None:
        hashes, tokens, parent = ev.block_hashes, ev.tokens_hashes, ev.parent_hash
        n = len(hashes)
        if n == 0 or len(tokens) != n:
            self._anomaly(Anomaly.MALFORMED, f"{n} block hashes, {len(tokens)} tokens hashes")
            return
        if len(set(hashes)) != n or (parent is not None and parent in hashes):
            self._anomaly(Anomaly.MALFORMED, "stored event repeats a hash or its parent")
            return
        st = self._rank(ev.dp_rank)
        source = ev.source
        src, mine = st.source(source)
        parent_seq: int | None = None
        if parent is not None:
            parent_seq = src.get(parent)
            if parent_seq is None:
                self._anomaly(
                    Anomaly.UNKNOWN_PARENT,
                    f"{source.value} rank {ev.dp_rank}: parent {parent} not held; {n} blocks rejected",
                )
                return
        try:
            seqs = sequence_hashes(tokens, parent_seq)
        except ValueError as exc:
            self._anomaly(Anomaly.MALFORMED, f"tokens hashes: {exc}")
            return
        blocks = st.blocks
        dedup = self._dedup
        tier = Tier.DEVICE if dedup else source
        prev_pub = self._published_parent(st, source, parent_seq)
        if (
            blocks.keys().isdisjoint(seqs)
            and src.keys().isdisjoint(hashes)
            and (not dedup or st.first.keys().isdisjoint(hashes))
        ):
            # The common case: no source holds any of these blocks yet. All C-level.
            blocks.update(zip(seqs, zip([parent_seq, *seqs[:-1]], tokens, hashes)))
            src.update(zip(hashes, seqs))
            mine.update(zip(seqs, hashes))
            if dedup:
                st.first.update(zip(hashes, seqs))
            self._writer.stored(ev.dp_rank, tier, prev_pub, list(hashes), list(tokens))
            return
        # Validate everything before changing anything: an event applies whole or not at all.
        for h, s in zip(hashes, seqs):
            held = src.get(h)
            if held is not None and held != s:
                self._anomaly(Anomaly.HASH_CONFLICT, f"{source.value} hash {h} already names another block")
                return
            if dedup and s not in blocks and h in st.first:
                self._anomaly(Anomaly.HASH_CONFLICT, f"hash {h} already published for another block")
                return

        prev_seq = parent_seq
        run_parent: int | None = None
        out_hashes: list[int] = []
        out_tokens: list[int] = []
        duplicates = 0
        for h, t, s in zip(hashes, tokens, seqs):
            block = blocks.get(s)
            new_block = block is None
            if block is None:
                block = blocks[s] = (prev_seq, t, h)
                if dedup:
                    st.first[h] = s
            if s in mine:
                duplicates += 1
                emit = False
            else:
                mine[s] = h
                src[h] = s
                emit = new_block if dedup else True
            pub = block[_FIRST] if dedup else mine[s]
            if emit:
                if not out_hashes:
                    run_parent = prev_pub
                out_hashes.append(pub)
                out_tokens.append(t)
            elif out_hashes:
                # A run of new blocks ended: its parent is the block before it.
                self._writer.stored(ev.dp_rank, tier, run_parent, out_hashes, out_tokens)
                out_hashes, out_tokens = [], []
            prev_pub, prev_seq = pub, s
        if out_hashes:
            self._writer.stored(ev.dp_rank, tier, run_parent, out_hashes, out_tokens)
        if duplicates:
            self.reannounced[source] += duplicates

    def _published_parent(self, st: _RankState, source: Tier, parent_seq: int | None) -> int | None:
        """The hash under which the routers know the parent block (None: a root)."""
        if parent_seq is None:
            return None
        return st.blocks[parent_seq][_FIRST] if self._dedup else st.held[source][parent_seq]

    def _drop(self, st: _RankState, source: Tier, hashes: Iterable[int]) -> tuple[list[int], int]:
        """Take ``hashes`` away from ``source``; returns the hashes to publish as
        removed and how many hashes the source did not hold."""
        src, mine = st.source(source)
        blocks = st.blocks
        dedup = self._dedup
        others = [m for t, m in st.held.items() if t is not source and m]
        out: list[int] = []
        unknown = 0
        for h in hashes:
            s = src.pop(h, None)
            if s is None:
                unknown += 1
                continue
            del mine[s]
            for m in others:
                if s in m:
                    break
            else:  # no other source holds it: the block is gone
                first = blocks.pop(s)[_FIRST]
                if dedup:
                    del st.first[first]
                    out.append(first)
            if not dedup:
                out.append(h)
        return out, unknown

    def _removed(self, ev: SourceRemoved) -> None:
        st = self._rank(ev.dp_rank)
        out, unknown = self._drop(st, ev.source, ev.block_hashes)
        if unknown:
            self._anomaly(
                Anomaly.UNKNOWN_REMOVE,
                f"{ev.source.value} rank {ev.dp_rank} removed {unknown} blocks it did not hold",
                unknown,
            )
        if out:
            self._writer.removed(ev.dp_rank, Tier.DEVICE if self._dedup else ev.source, out)

    def _cleared(self, ev: SourceCleared) -> None:
        st = self._rank(ev.dp_rank)
        src, _ = st.source(ev.source)
        # Newest first: children go before their parents.
        out, _ = self._drop(st, ev.source, list(reversed(src)))
        if not out:
            return
        tier = Tier.DEVICE if self._dedup else ev.source
        if not self._dedup or not st.blocks:
            # Nothing is left on that tier of that rank: one ``cleared`` (the routers
            # scope it to the rank and tier) says it more compactly than the list.
            self._writer.cleared(ev.dp_rank, tier)
        else:
            self._writer.removed(ev.dp_rank, tier, out)

    # ------------------------------------------------------------------ lookups

    def lookup(self, dp_rank: int, source: Tier, block_hash: int) -> tuple[int | None, int] | None:
        """What ``source`` knows of its block ``block_hash``: (the source's hash of its
        parent, None for a root or a parent it no longer holds; the tokens hash), or
        None when it does not hold it."""
        st = self._ranks.get(dp_rank)
        src = st.sources.get(source) if st else None
        seq = src.get(block_hash) if src else None
        if seq is None:
            return None
        assert st is not None
        parent_seq, tokens, _ = st.blocks[seq]
        parent = None if parent_seq is None else st.held[source].get(parent_seq)
        return parent, tokens

    # ------------------------------------------------------------------ state

    def dump_state(self) -> dict[int, bytes]:
        """Everything held, per rank, as bytes (:meth:`load_state` reads them back)."""
        return {rank: _pack_rank(st) for rank, st in self._ranks.items()}

    def load_state(self, state: dict[int, bytes]) -> None:
        """Replace what is held by a :meth:`dump_state` (publishes nothing)."""
        self._ranks = {rank: _unpack_rank(data, self._dedup) for rank, data in state.items()}

    # ------------------------------------------------------------------ replay

    def replay(self, writer: RouterEventWriter) -> None:
        """Write every held block as ``stored`` events, parents before children, the
        way the live stream would have published it (same tiers and hashes)."""
        for rank in sorted(self._ranks):
            st = self._ranks[rank]
            if self._dedup:
                self._replay_tier(writer, rank, st, Tier.DEVICE, st.blocks.keys())
            else:
                for tier, mine in st.held.items():
                    self._replay_tier(writer, rank, st, tier, mine.keys())

    def _replay_tier(
        self,
        writer: RouterEventWriter,
        rank: int,
        st: _RankState,
        tier: Tier,
        seqs: Collection[int],
    ) -> None:
        blocks = st.blocks
        # In dedup every block counts; in passthrough only what this tier's source holds.
        names: dict[int, int] = st.held[tier] if not self._dedup else {s: b[_FIRST] for s, b in blocks.items()}

        done: dict[int, int] = {}  # seq → published hash
        orphans: set[int] = set()
        for start in list(seqs):
            if start in done or start in orphans:
                continue
            # Walk up to the first ancestor already written (or a root), then write down.
            path: list[int] = []
            s: int | None = start
            orphan = False
            while s is not None and s not in done:
                if s not in names or s in orphans:
                    orphan = True
                    break
                path.append(s)
                s = blocks[s][_PARENT]
            if orphan:
                orphans.update(path)
                self._anomaly(Anomaly.REPLAY_ORPHAN, f"{tier.value} rank {rank}: {len(path)} blocks without parent", len(path))
                continue
            parent_pub = done[s] if s is not None else None
            for s in reversed(path):
                h = names[s]
                writer.stored(rank, tier, parent_pub, [h], [blocks[s][_TOKENS]])
                done[s] = parent_pub = h

