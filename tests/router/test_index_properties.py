"""The fast tier index against the reference model, after every event of random
sequences (many workers, ranks and tiers; interleaved stores, removes, clears, worker
removals and bad events; prompts routed to workers and expected there, refuted, expiring
on a clock that moves on and skews, bounded by capacities)."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstream.events.model import Cleared, Removed, Stored
from kvstream.hashing import sequence_hashes
from kvstream.router.index import REASONS, TieredIndex, WorkerKey

from .reference import TIERS, ReferenceIndex

#: pick(lo, hi) → an int in [lo, hi]; drawn by hypothesis or by a seeded Random.
Pick = Callable[[int, int], int]

N_BLOCK_HASHES = 40  # small pools, so that parents, repeats and unknown removes happen
N_TOKENS_HASHES = 3  # small alphabet, so that workers share prefixes


#: The expectations' TTL in the sequences (the clock moves 0-3 per step).
TTL = 12.0


def gen_step(pick: Pick, ref: ReferenceIndex, workers: int) -> object:
    """One step: a router event, or ("remove_worker", id), ("expect", key, prompt, t
    back), ("unexpect", key, prompt), ("cap", key, cap)."""
    worker, rank = pick(0, workers - 1), pick(0, 2)
    tier = TIERS[pick(0, len(TIERS) - 1)]
    kind = pick(0, 119)
    if kind >= 100:
        key = WorkerKey(worker, rank)
        if kind < 112:
            return ("expect", key, gen_prompt(pick, ref), pick(0, 2) if pick(0, 3) == 0 else 0)
        if kind < 117:
            return ("unexpect", key, gen_prompt(pick, ref))
        return ("cap", key, None if pick(0, 2) == 0 else pick(0, 6))
    if kind < 1:
        return ("remove_worker", worker)
    if kind < 3:
        return Cleared(worker, rank, tier, 0, 0)
    held = list(ref.blocks.get((tier, WorkerKey(worker, rank)), {}))
    if kind < 25:
        n = pick(1, 4)
        hashes = tuple(
            held[pick(0, len(held) - 1)] if held and pick(0, 3) else pick(0, N_BLOCK_HASHES)
            for _ in range(n)
        )
        if pick(0, 99) == 0:
            hashes = (*hashes, -1)  # out of range: never held
        return Removed(worker, rank, tier, 0, 0, hashes)
    n = pick(1, 5)
    choice = pick(0, 9)
    if choice < 3:
        parent = None
    elif held and choice < 9:
        parent = held[pick(0, len(held) - 1)]
    else:
        parent = pick(0, N_BLOCK_HASHES)  # often not held: rejected
    hashes = tuple(pick(0, N_BLOCK_HASHES) for _ in range(n))  # may repeat: invalid
    tokens = [pick(0, N_TOKENS_HASHES) for _ in range(n)]
    bad = pick(0, 299)
    if bad == 0:
        tokens[-1] = 2**64  # out of range: invalid
    elif bad == 1:
        hashes = (*hashes[:-1], -5)
    elif bad == 2:
        parent = 2**65
    return Stored(worker, rank, tier, 0, 0, parent, hashes, tuple(tokens))


def gen_prompt(pick: Pick, ref: ReferenceIndex) -> list[int]:
    """A prompt that often follows a held path, then goes on at random."""
    paths = [p for held in ref.blocks.values() for p in held.values()]
    prefix = list(paths[pick(0, len(paths) - 1)]) if paths and pick(0, 3) else []
    return prefix + [pick(0, N_TOKENS_HASHES) for _ in range(pick(0, 4))]


def check(
    fast: TieredIndex,
    ref: ReferenceIndex,
    prompts: list[list[int]],
    keys: set[WorkerKey] | None = None,
) -> None:
    """Compare the observable state: all of it, or when ``keys`` are given, the blocks
    (hence tree sizes) of those workers only."""
    assert set(fast.workers()) == ref.known
    assert fast.expected_counts() == ref.expected_counts()
    if keys is None:
        assert fast.tree_sizes() == ref.tree_sizes()
    assert {r: fast.counters[r] for r in REASONS} == {r: ref.counters[r] for r in REASONS}
    for key in ref.known if keys is None else keys & ref.known:
        for tier in TIERS:
            expected = {
                bh: sequence_hashes(path)[-1]
                for bh, path in ref.blocks.get((tier, key), {}).items()
            }
            assert dict(fast.blocks(key, tier)) == expected, (key, tier)
    for local in prompts:
        expected = ref.find_matches_by_tier(local)
        assert fast.find_matches_by_tier(local) == expected, local
        # The same answer when the caller passes the sequence hashes.
        assert fast.find_matches_by_tier(local, sequence_hashes(local)) == expected


def run_sequence(pick: Pick, steps: int, workers: int, prompts_per_step: int) -> None:
    fast, ref = TieredIndex(TTL, 8), ReferenceIndex(TTL, 8)
    now = 0.0
    for i in range(steps):
        now += pick(0, 3)
        step = gen_step(pick, ref, workers)
        touched: set[WorkerKey] = set()
        if isinstance(step, tuple) and step[0] == "remove_worker":
            # Half of them as a lease's expiry: the device blocks become expected.
            demote = now if pick(0, 1) else None
            fast.remove_worker(step[1], demote)
            ref.remove_worker(step[1], demote)
        elif isinstance(step, tuple) and step[0] == "expect":
            _, key, local, back = step
            fast.expect(key, sequence_hashes(local), now - back)
            ref.expect(key, local, now - back)
        elif isinstance(step, tuple) and step[0] == "unexpect":
            fast.unexpect(step[1], sequence_hashes(step[2]))
            ref.unexpect(step[1], step[2])
        elif isinstance(step, tuple):
            fast.set_expected_capacity(step[1], step[2])
            ref.set_cap(step[1], step[2])
        else:
            fast.apply(step)  # type: ignore[arg-type]
            ref.apply(step)  # type: ignore[arg-type]
            touched = {WorkerKey(step.worker_id, step.dp_rank)}  # type: ignore[attr-defined]
        if pick(0, 2) == 0:
            fast.expire_expected(now)
            ref.expire(now)
        # Every step: the touched worker's blocks and the matches; every 50: everything.
        prompts = [gen_prompt(pick, ref) for _ in range(prompts_per_step)]
        check(fast, ref, prompts, None if i % 50 == 49 else touched)
    check(fast, ref, [])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data(), st.integers(1, 5))
def test_index_matches_reference(data: st.DataObject, workers: int) -> None:
    """Shrinkable sequences: every choice is a hypothesis draw."""
    pick: Pick = lambda lo, hi: data.draw(st.integers(lo, hi))  # noqa: E731
    run_sequence(pick, steps=data.draw(st.integers(1, 60)), workers=workers, prompts_per_step=2)


@pytest.mark.slow
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.randoms(use_true_random=True), st.integers(2, 8))
def test_index_matches_reference_long(rng: random.Random, workers: int) -> None:
    """Hundreds of sequences of thousands of events (hypothesis seeds each sequence)."""
    run_sequence(rng.randint, steps=2000, workers=workers, prompts_per_step=1)
