"""Consolidator: exact router events of both modes, for every order of the sources."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstream.events.model import Tier
from kvstream.hashing import local_hashes, sequence_hashes
from kvstream.worker.consolidator import Anomaly, Consolidator, Mode
from kvstream.worker.source_events import SourceCleared, SourceRemoved, SourceStored

G1, G2, G3 = Tier.DEVICE, Tier.HOST_PINNED, Tier.DISK
SOURCES = (G1, G2, G3)
LOCAL = tuple(local_hashes(list(range(64)), 16))  # 4 blocks
SEQ = tuple(sequence_hashes(LOCAL))
#: Each source names block i by its own opaque hash.
BASE = {G1: 1000, G2: 2000, G3: 3000}


def h(source: Tier, i: int) -> int:
    return BASE[source] + i


@dataclass
class Recorder:
    """A RouterEventWriter that keeps what it gets, as plain tuples."""

    events: list[tuple] = field(default_factory=list)

    def stored(self, dp_rank, tier, parent_hash, block_hashes, tokens_hashes):
        self.events.append(("stored", dp_rank, tier, parent_hash, tuple(block_hashes), tuple(tokens_hashes)))

    def removed(self, dp_rank, tier, block_hashes):
        self.events.append(("removed", dp_rank, tier, tuple(block_hashes)))

    def cleared(self, dp_rank, tier=Tier.DEVICE):
        self.events.append(("cleared", dp_rank, tier))

    def take(self) -> list[tuple]:
        out, self.events = self.events, []
        return out


def store(source: Tier, first: int, n: int, rank: int = 0) -> SourceStored:
    parent = h(source, first - 1) if first else None
    return SourceStored(
        source=source,
        dp_rank=rank,
        parent_hash=parent,
        block_hashes=tuple(h(source, i) for i in range(first, first + n)),
        tokens_hashes=LOCAL[first : first + n],
    )


def remove(source: Tier, *idx: int, rank: int = 0) -> SourceRemoved:
    return SourceRemoved(source=source, dp_rank=rank, block_hashes=tuple(h(source, i) for i in idx))


def make(mode: Mode) -> tuple[Consolidator, Recorder]:
    rec = Recorder()
    return Consolidator(rec, mode), rec


@pytest.mark.parametrize("store_order", list(itertools.permutations(SOURCES)))
@pytest.mark.parametrize("remove_order", list(itertools.permutations(SOURCES)))
def test_dedup_every_order(store_order, remove_order):
    c, rec = make(Mode.DEDUP)
    first = store_order[0]
    for i, src in enumerate(store_order):
        c.on_source_event(store(src, 0, 2))
        expected = (
            [("stored", 0, G1, None, (h(first, 0), h(first, 1)), LOCAL[:2])] if i == 0 else []
        )
        assert rec.take() == expected, f"store #{i} from {src}"
    assert c.block_count() == 2
    assert c.holders(0, SEQ[1]) == {s: h(s, 1) for s in SOURCES}
    for i, src in enumerate(remove_order):
        c.on_source_event(remove(src, 1, 0))
        last = i == len(remove_order) - 1
        # Published under the first source's hashes, whoever removes last.
        expected = [("removed", 0, G1, (h(first, 1), h(first, 0)))] if last else []
        assert rec.take() == expected, f"remove #{i} from {src}"
    assert c.block_count() == 0
    assert not c.anomalies


@pytest.mark.parametrize("store_order", list(itertools.permutations(SOURCES)))
@pytest.mark.parametrize("remove_order", list(itertools.permutations(SOURCES)))
def test_passthrough_every_order(store_order, remove_order):
    c, rec = make(Mode.PASSTHROUGH)
    for src in store_order:
        c.on_source_event(store(src, 0, 2))
        assert rec.take() == [("stored", 0, src, None, (h(src, 0), h(src, 1)), LOCAL[:2])]
    for src in remove_order:
        c.on_source_event(remove(src, 1, 0))
        assert rec.take() == [("removed", 0, src, (h(src, 1), h(src, 0)))]
    assert c.block_count() == 0
    assert not c.anomalies


@pytest.mark.parametrize("order", list(itertools.permutations(SOURCES)))
def test_child_parent_rewritten_to_first_seen_hash(order):
    """Block 0 is seen by every source, then each source extends the chain by one
    block: dedup names the parent by the hash under which it was published."""
    c, rec = make(Mode.DEDUP)
    for src in order:
        c.on_source_event(store(src, 0, 1))
    rec.take()
    owner = order[0]
    published = {0: h(owner, 0)}
    for i, src in enumerate(order):
        c.on_source_event(store(src, 1, 1))
        if i == 0:
            published[1] = h(src, 1)
            assert rec.take() == [("stored", 0, G1, published[0], (h(src, 1),), LOCAL[1:2])]
        else:
            assert rec.take() == []
    # The first source drops everything; the block stays published under its hashes.
    c.on_source_event(remove(owner, 1, 0))
    assert rec.take() == []
    later = order[1]
    c.on_source_event(store(later, 2, 1))
    assert rec.take() == [("stored", 0, G1, published[1], (h(later, 2),), LOCAL[2:3])]


def test_passthrough_child_keeps_source_parent():
    c, rec = make(Mode.PASSTHROUGH)
    c.on_source_event(store(G1, 0, 1))
    c.on_source_event(store(G2, 0, 2))
    assert rec.take() == [
        ("stored", 0, G1, None, (h(G1, 0),), LOCAL[:1]),
        ("stored", 0, G2, None, (h(G2, 0), h(G2, 1)), LOCAL[:2]),
    ]


def test_dedup_splits_runs_around_known_blocks():
    """G1 holds blocks 0-1; G2 stores 0-3 of which only 2-3 are new (their parent is
    named by G1's hash); then G3 stores 0-3 of which nothing is new."""
    c, rec = make(Mode.DEDUP)
    c.on_source_event(store(G1, 0, 2))
    rec.take()
    c.on_source_event(store(G2, 0, 4))
    assert rec.take() == [("stored", 0, G1, h(G1, 1), (h(G2, 2), h(G2, 3)), LOCAL[2:4])]
    c.on_source_event(store(G3, 0, 4))
    assert rec.take() == []


def test_dedup_run_in_the_middle():
    c, rec = make(Mode.DEDUP)
    c.on_source_event(store(G1, 0, 1))
    # G2 holds block 0 under its own name, then blocks 1..2 where block 1 is new, 2 too.
    c.on_source_event(store(G2, 0, 1))
    c.on_source_event(store(G2, 1, 1))
    c.on_source_event(store(G1, 1, 3))  # 1 known (from G2), 2 and 3 new
    assert rec.take() == [
        ("stored", 0, G1, None, (h(G1, 0),), LOCAL[:1]),
        ("stored", 0, G1, h(G1, 0), (h(G2, 1),), LOCAL[1:2]),
        ("stored", 0, G1, h(G2, 1), (h(G1, 2), h(G1, 3)), LOCAL[2:4]),
    ]


def test_ranks_are_separate():
    c, rec = make(Mode.DEDUP)
    c.on_source_event(store(G1, 0, 1, rank=0))
    c.on_source_event(store(G1, 0, 1, rank=1))
    assert rec.take() == [
        ("stored", 0, G1, None, (h(G1, 0),), LOCAL[:1]),
        ("stored", 1, G1, None, (h(G1, 0),), LOCAL[:1]),
    ]
    assert c.block_count(0) == c.block_count(1) == 1


def test_unknown_parent_rejected_whole_and_counted():
    c, rec = make(Mode.DEDUP)
    c.on_source_event(store(G1, 0, 1))
    rec.take()
    c.on_source_event(store(G2, 1, 2))  # G2 never stored block 0
    assert rec.take() == []
    assert c.anomalies == {Anomaly.UNKNOWN_PARENT: 1}
    assert c.block_count() == 1


def test_unknown_remove_counted_per_hash():
    for mode in Mode:
        c, rec = make(mode)
        c.on_source_event(store(G1, 0, 2))
        rec.take()
        c.on_source_event(remove(G2, 0, 1))  # G2 holds nothing
        c.on_source_event(SourceRemoved(G1, 0, (h(G1, 1), 99)))
        assert c.anomalies == {Anomaly.UNKNOWN_REMOVE: 3}
        assert rec.take() == [("removed", 0, G1, (h(G1, 1),))]


def test_reannounced_store_counted_not_republished():
    for mode in Mode:
        c, rec = make(mode)
        c.on_source_event(store(G1, 0, 2))
        rec.take()
        c.on_source_event(store(G1, 0, 3))
        assert rec.take() == [("stored", 0, G1, h(G1, 1), (h(G1, 2),), LOCAL[2:3])]
        # An engine re-announcing its cached prefix is normal: counted, not an anomaly.
        assert c.reannounced == {G1: 2}
        assert not c.anomalies


@pytest.mark.parametrize(
    "event",
    [
        SourceStored(G1, 0, None, (), ()),
        SourceStored(G1, 0, None, (1, 2), (LOCAL[0],)),
        SourceStored(G1, 0, None, (1, 1), LOCAL[:2]),
        SourceStored(G1, 0, 1, (1, 2), LOCAL[:2]),
        SourceStored(G1, 0, None, (1, 2), (LOCAL[0], -5)),
    ],
    ids=["empty", "lengths", "repeat", "own-parent", "bad-tokens-hash"],
)
def test_malformed_store_rejected(event):
    c, rec = make(Mode.DEDUP)
    c.on_source_event(event)
    assert rec.take() == []
    assert c.anomalies == {Anomaly.MALFORMED: 1}
    assert c.block_count() == 0


def test_hash_conflict_rejects_whole_event():
    for mode in Mode:
        c, rec = make(mode)
        c.on_source_event(store(G1, 0, 1))
        rec.take()
        # G1 reuses hash of block 0 for a different block (block 2's tokens, as a root).
        c.on_source_event(SourceStored(G1, 0, None, (5, h(G1, 0)), LOCAL[2:4]))
        assert rec.take() == []
        assert c.anomalies == {Anomaly.HASH_CONFLICT: 1}
        assert c.block_count() == 1


def test_dedup_published_hash_collision_refused():
    c, rec = make(Mode.DEDUP)
    c.on_source_event(store(G1, 0, 1))
    rec.take()
    # G2 names a different block by the hash under which G1's block 0 is published.
    c.on_source_event(SourceStored(G2, 0, None, (h(G1, 0),), LOCAL[3:4]))
    assert rec.take() == []
    assert c.anomalies == {Anomaly.HASH_CONFLICT: 1}


def test_clear_of_one_source():
    c, rec = make(Mode.DEDUP)
    c.on_source_event(store(G1, 0, 3))
    c.on_source_event(store(G2, 0, 1))
    rec.take()
    c.on_source_event(SourceCleared(G1, 0))
    # Block 0 is still on G2; blocks 1, 2 are gone, children first.
    assert rec.take() == [("removed", 0, G1, (h(G1, 2), h(G1, 1)))]
    c.on_source_event(SourceCleared(G2, 0))
    assert rec.take() == [("cleared", 0, G1)]
    c.on_source_event(SourceCleared(G2, 0))  # nothing held: nothing to say
    assert rec.take() == []
    assert not c.anomalies


def test_clear_passthrough():
    c, rec = make(Mode.PASSTHROUGH)
    c.on_source_event(store(G1, 0, 2))
    c.on_source_event(store(G2, 0, 2))
    rec.take()
    # Each tier of the rank is cleared on its own; the other tier keeps its blocks.
    c.on_source_event(SourceCleared(G2, 0))
    assert rec.take() == [("cleared", 0, G2)]
    c.on_source_event(SourceCleared(G1, 0))
    assert rec.take() == [("cleared", 0, G1)]


def test_clear_scoped_to_its_rank():
    c, rec = make(Mode.DEDUP)
    c.on_source_event(store(G1, 0, 2))
    c.on_source_event(SourceStored(G1, 1, None, (h(G1, 0),), LOCAL[:1]))
    rec.take()
    c.on_source_event(SourceCleared(G1, 1))
    assert rec.take() == [("cleared", 1, G1)]
    assert c.block_count(0) == 2 and c.block_count(1) == 0


def test_state_dump_and_load_round_trip():
    for mode in Mode:
        c, rec = make(mode)
        c.on_source_event(store(G1, 0, 3))
        c.on_source_event(store(G2, 0, 2))
        c.on_source_event(SourceStored(G1, 2, None, (h(G1, 0),), LOCAL[:1]))
        c.on_source_event(remove(G1, 2, 0))
        d, _ = make(mode)
        d.load_state(c.dump_state())
        a, b = Recorder(), Recorder()
        c.replay(a)
        d.replay(b)
        assert a.events == b.events
        # The loaded state goes on exactly like the original.
        for x in (c, d):
            x.on_source_event(SourceCleared(G2, 0))
            x.on_source_event(store(G1, 0, 3))
        assert c.dump_state() == d.dump_state()
        assert d.lookup(0, G1, h(G1, 1)) == (h(G1, 0), LOCAL[1])


def test_replay_dedup_parents_first_and_orphans_counted():
    c, rec = make(Mode.DEDUP)
    c.on_source_event(store(G1, 0, 2))
    c.on_source_event(store(G2, 0, 3))
    c.on_source_event(store(G3, 0, 1))
    c.on_source_event(remove(G1, 1, 0))
    rec.take()
    replayed = Recorder()
    c.replay(replayed)
    assert replayed.events == [
        ("stored", 0, G1, None, (h(G1, 0),), LOCAL[0:1]),
        ("stored", 0, G1, h(G1, 0), (h(G1, 1),), LOCAL[1:2]),
        ("stored", 0, G1, h(G1, 1), (h(G2, 2),), LOCAL[2:3]),
    ]
    # Now G2 drops block 1 while keeping block 2: block 2 can no longer be replayed.
    c.on_source_event(remove(G2, 1))
    assert rec.take() == [("removed", 0, G1, (h(G1, 1),))]
    replayed = Recorder()
    c.replay(replayed)
    assert replayed.events == [("stored", 0, G1, None, (h(G1, 0),), LOCAL[0:1])]
    assert c.anomalies == {Anomaly.REPLAY_ORPHAN: 1}


def test_replay_passthrough_per_tier():
    c, rec = make(Mode.PASSTHROUGH)
    c.on_source_event(store(G2, 0, 2))
    c.on_source_event(store(G1, 0, 1))
    replayed = Recorder()
    c.replay(replayed)
    assert replayed.events == [
        ("stored", 0, G2, None, (h(G2, 0),), LOCAL[0:1]),
        ("stored", 0, G2, h(G2, 0), (h(G2, 1),), LOCAL[1:2]),
        ("stored", 0, G1, None, (h(G1, 0),), LOCAL[0:1]),
    ]


# ---------------------------------------------------------------- property test


class RouterModel:
    """A plain router fold (DESIGN.md §2 apply rules) over the recorded events: per
    (rank, tier) published hash → sequence hash; rejects what a router rejects."""

    def __init__(self) -> None:
        self.chains: dict[tuple[int, Tier], dict[int, int]] = {}
        self.rejected = 0

    def apply(self, ev: tuple) -> None:
        if ev[0] == "cleared":
            self.chains.pop((ev[1], ev[2]), None)
            return
        if ev[0] == "removed":
            _, rank, tier, hashes = ev
            chain = self.chains.setdefault((rank, tier), {})
            for x in hashes:
                if chain.pop(x, None) is None:
                    self.rejected += 1
            return
        _, rank, tier, parent, hashes, tokens = ev
        chain = self.chains.setdefault((rank, tier), {})
        if parent is not None and parent not in chain:
            self.rejected += 1
            return
        prev = chain[parent] if parent is not None else None
        for x, s in zip(hashes, sequence_hashes(list(tokens), prev)):
            if x in chain:
                self.rejected += 1
            chain[x] = s

    def reachable(self) -> set[tuple[int, Tier, int]]:
        """Blocks whose parent chain is complete, as (rank, tier, seq)."""
        return {(rank, tier, s) for (rank, tier), chain in self.chains.items() for s in chain.values()}


# An op: (kind, source, rank, prompt, length) over 3 prompts that share block 0.
PROMPTS = [
    local_hashes(list(range(64)), 16),
    local_hashes(list(range(16)) + list(range(100, 148)), 16),
    local_hashes(list(range(16)) + list(range(200, 248)), 16),
]
ops = st.lists(
    st.tuples(
        st.sampled_from(["store", "store", "store", "remove", "clear"]),
        st.sampled_from(SOURCES),
        st.integers(0, 1),
        st.integers(0, 2),
        st.integers(1, 4),
    ),
    max_size=40,
)


#: Parent sequence hash of every block of the prompts.
PARENT = {
    s: (seqs[i - 1] if i else None)
    for seqs in map(sequence_hashes, PROMPTS)
    for i, s in enumerate(seqs)
}


def source_hash(source: Tier, seq: int) -> int:
    """A source's opaque name for a block: distinct per source, stable per block."""
    return (seq ^ (0x9E3779B97F4A7C15 * (list(SOURCES).index(source) + 1))) & ((1 << 64) - 1)


@settings(max_examples=150, deadline=None)
@given(ops=ops, mode=st.sampled_from(list(Mode)))
def test_live_fold_equals_replay_and_sources(ops, mode):
    """Random stores (whole prompt prefixes), leaf removals and clears over three
    sources: the router fold of the live events matches what the sources hold, never
    rejects anything, and equals the fold of a replay."""
    c, rec = make(mode)
    held: dict[tuple[Tier, int], set[int]] = {}  # what each (source, rank) holds, by seq
    for kind, source, rank, p, n in ops:
        seqs = sequence_hashes(PROMPTS[p][:n])
        mine = held.setdefault((source, rank), set())
        if kind == "store":
            have = 0
            while have < n and seqs[have] in mine:
                have += 1
            if have == n:
                continue
            parent = source_hash(source, seqs[have - 1]) if have else None
            c.on_source_event(
                SourceStored(
                    source, rank, parent,
                    tuple(source_hash(source, s) for s in seqs[have:n]),
                    tuple(PROMPTS[p][have:n]),
                )
            )
            mine.update(seqs[have:n])
        elif kind == "remove":
            # Remove the deepest held block of this prompt if it is a leaf for the source.
            deepest = [s for s in seqs if s in mine]
            if not deepest:
                continue
            leaf = deepest[-1]
            if any(PARENT[x] == leaf for x in mine):
                continue  # not a leaf for this source
            c.on_source_event(SourceRemoved(source, rank, (source_hash(source, leaf),)))
            mine.discard(leaf)
        else:
            c.on_source_event(SourceCleared(source, rank))
            mine.clear()
    assert not c.anomalies
    live = RouterModel()
    for ev in rec.take():
        live.apply(ev)
    assert live.rejected == 0
    if mode is Mode.DEDUP:
        expected = {(r, G1, s) for (src, r), seqs in held.items() for s in seqs}
    else:
        expected = {(r, src, s) for (src, r), seqs in held.items() for s in seqs}
    assert live.reachable() == expected
    replay, replayed = RouterModel(), Recorder()
    c.replay(replayed)
    for ev in replayed.events:
        replay.apply(ev)
    assert replay.rejected == 0
    assert replay.reachable() == expected
