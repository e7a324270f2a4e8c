"""Router: events in, decisions out (hashing, tier matching, load, scheduling together)."""

from __future__ import annotations

import random

import pytest

from kvstream.events.model import Cleared, Removed, Stored, Tier
from kvstream.hashing import block_hashes, local_hashes
from kvstream.router import (
    AddRequest,
    FreeRequest,
    PrefillDone,
    Router,
    RouterConfig,
    SchedulerConfig,
    SchedulerOverrides,
    TierOverlap,
    WorkerKey,
)
from kvstream.router.errors import (
    DuplicateRequestError,
    NoEligibleWorkerError,
    UnknownRequestError,
    UnknownWorkerError,
)

from .reference_router import ReferenceRouter

PROMPT = list(range(1000, 1000 + 16 * 8))  # 8 blocks of 16
LOCAL = local_hashes(PROMPT)


class Clock:
    now = 5000.0

    def __call__(self) -> float:
        return self.now


def store(worker: int, tier: Tier, n: int, rank: int = 0, ids: int = 0, lora: str | None = None) -> Stored:
    local = local_hashes(PROMPT, lora_name=lora)[:n]
    return Stored(worker, rank, tier, 0, 1, None, tuple(ids + i for i in range(n)), tuple(local))


def make_router(**sched: object) -> Router:
    return Router(RouterConfig(scheduler=SchedulerConfig(**sched)), clock=Clock(), rng=random.Random(0))  # type: ignore[arg-type]


def test_longest_device_prefix_wins_and_every_candidate_is_explained() -> None:
    r = make_router()
    r.apply_event(store(1, Tier.DEVICE, 2))
    r.apply_event(store(2, Tier.DEVICE, 6))
    r.apply_event(Cleared(3, 0, Tier.DEVICE, 0, 0))  # known, no blocks
    d = r.find_best_match(PROMPT)
    assert d.worker == WorkerKey(2, 0)
    assert (d.isl, d.blocks, d.op) == (128, 8, None)
    by = {c.worker: c for c in d.candidates}
    assert set(by) == {WorkerKey(1, 0), WorkerKey(2, 0), WorkerKey(3, 0)}
    assert by[WorkerKey(2, 0)].overlap == TierOverlap(device=6)
    assert d.overlaps[WorkerKey(1, 0)] == TierOverlap(device=2)
    assert d.logits == {WorkerKey(1, 0): 14, WorkerKey(2, 0): 10, WorkerKey(3, 0): 16}
    # 8 blocks, credit 6: prefill cost 2, decode 8 → 10; worker 3: 8 + 8 = 16.
    assert [by[WorkerKey(w, 0)].logit for w in (1, 2, 3)] == [14, 10, 16]
    assert d.chosen.logit == 10 and d.chosen.probability == 1.0


def test_lower_tiers_continue_the_device_prefix_and_weights_decide() -> None:
    r = make_router()
    r.apply_event(store(1, Tier.DEVICE, 4))  # credit 4
    r.apply_event(store(2, Tier.DEVICE, 2))
    r.apply_event(store(2, Tier.HOST_PINNED, 6, ids=100))  # device 2 + host 4 → 5
    r.apply_event(store(3, Tier.DISK, 8, ids=200))  # disk from block 0 → 2
    d = r.find_best_match(PROMPT, query_only=True)
    by = {c.worker.worker_id: c for c in d.candidates}
    assert by[2].overlap == TierOverlap(device=2, host_pinned=4)
    assert by[3].overlap == TierOverlap(disk=8)
    assert [by[w].credit for w in (1, 2, 3)] == [4, 5, 2]
    assert d.worker == WorkerKey(2, 0)
    d = r.find_best_match(PROMPT, overrides=SchedulerOverrides(host_cache_hit_weight=0.25))
    assert d.worker == WorkerKey(1, 0)  # worker 2's credit falls to 3
    d = r.find_best_match(PROMPT, overrides=SchedulerOverrides(disk_cache_hit_weight=1.0))
    assert d.worker == WorkerKey(3, 0)


def test_requests_load_workers_until_freed() -> None:
    r = make_router()
    r.apply_event(store(1, Tier.DEVICE, 8))
    r.apply_event(store(2, Tier.DEVICE, 8, ids=50))
    r.apply_event(store(2, Tier.DEVICE, 8, rank=1, ids=60))
    d = r.find_best_match(PROMPT, request_id="r1")
    first = d.worker
    assert isinstance(d.op, AddRequest)
    assert d.op.request_id == "r1" and (d.op.worker_id, d.op.dp_rank) == first
    assert d.op.overlap_tokens == 128 and d.op.timestamp == 5000.0
    assert d.op.sequence_hashes == tuple(block_hashes(PROMPT)[1])
    # The same prompt again: the loaded candidate holds its blocks but has a load entry.
    d2 = r.find_best_match(PROMPT, request_id="r2")
    loaded = next(c for c in d2.candidates if c.worker == first)
    assert (loaded.active_decode_blocks, loaded.new_blocks, loaded.active_requests) == (8, 0, 1)
    assert loaded.logit == 8  # prefill (0 + 0 + 128)/16 − credit 8 = 0; decode 8 + 0
    # The idle ones: prefill cost 0, decode 0 + 8 = 8 too: a three-way tie.
    assert [c.logit for c in d2.candidates] == [8, 8, 8]
    assert [c.probability for c in d2.candidates] == pytest.approx([1 / 3] * 3)
    with pytest.raises(DuplicateRequestError):
        r.find_best_match(PROMPT, request_id="r1")
    assert r.prefill_done("r1") == PrefillDone("r1", 5000.0)
    assert r.free("r1") == FreeRequest("r1", 5000.0)
    with pytest.raises(UnknownRequestError, match="'r1'"):
        r.free("r1")
    # A peer's op, applied as it comes from kvstream.active.
    r.apply_active(AddRequest("peer", 1, 0, 128, 0, d.op.sequence_hashes, 5000.0))
    assert r.load(WorkerKey(1, 0)) is not None


def test_query_only_and_anonymous_requests_leave_no_load() -> None:
    r = make_router()
    r.apply_event(store(1, Tier.DEVICE, 3))
    assert r.find_best_match(PROMPT, request_id="q", query_only=True).op is None
    assert r.find_best_match(PROMPT).op is None
    assert r.active_requests() == 0


def test_expired_requests_stop_counting() -> None:
    clock = Clock()
    r = Router(RouterConfig(), clock=clock, rng=random.Random(0))
    r.apply_event(store(1, Tier.DEVICE, 3))
    r.find_best_match(PROMPT, request_id="a")
    clock.now += 301
    d = r.find_best_match(PROMPT, query_only=True)
    assert d.chosen.active_requests == 0 and r.active_requests() == 0


def test_lora_prompts_do_not_match_base_blocks() -> None:
    r = make_router()
    r.apply_event(store(1, Tier.DEVICE, 8))
    r.apply_event(store(2, Tier.DEVICE, 8, ids=10, lora="my-lora"))
    assert r.find_best_match(PROMPT).worker == WorkerKey(1, 0)
    assert r.find_best_match(PROMPT, lora_name="my-lora").worker == WorkerKey(2, 0)


def test_workers_removal_and_errors() -> None:
    r = make_router()
    with pytest.raises(NoEligibleWorkerError, match="no workers known"):
        r.find_best_match(PROMPT)
    r.apply_event(store(1, Tier.DEVICE, 8))
    r.apply_event(Removed(2, 3, Tier.DISK, 0, 1, (42,)))  # unknown remove: still known
    assert r.workers() == [WorkerKey(1, 0), WorkerKey(2, 3)]
    assert r.rejections()["removed_unknown_block"] == 1
    r.find_best_match(PROMPT, request_id="x", overrides=SchedulerOverrides(allowed_workers=frozenset({1})))
    assert r.remove_worker(1) == [WorkerKey(1, 0)]
    assert r.workers() == [WorkerKey(2, 3)] and r.active_requests() == 0
    with pytest.raises(UnknownWorkerError, match="worker 1 is not known"):
        r.remove_worker(1)
    with pytest.raises(NoEligibleWorkerError, match="allowed workers"):
        r.find_best_match(PROMPT, overrides=SchedulerOverrides(allowed_workers=frozenset({1})))
    # A short prompt (no full block) still routes: prefill isl/B only.
    d = r.find_best_match([1, 2, 3])
    assert (d.blocks, d.chosen.logit) == (0, 3 / 16)


@pytest.mark.parametrize("router", [Router, ReferenceRouter], ids=["core", "reference"])
@pytest.mark.parametrize("policy", ["kv", "ttft"])
def test_candidates_limit_the_choice_and_admit_unindexed_workers(router: type, policy: str) -> None:
    """The gateway's candidates: only the given workers compete (every rank the index
    knows of them), and a given worker that has published nothing competes with no
    overlap and takes load like any other, in the core and in the reference model."""
    r = router(RouterConfig(scheduler=SchedulerConfig(policy=policy)), clock=Clock(), rng=random.Random(0))
    r.apply_event(store(1, Tier.DEVICE, 8))
    r.apply_event(store(2, Tier.DEVICE, 4))
    r.apply_event(store(2, Tier.DEVICE, 6, rank=1, ids=60))
    assert r.find_best_match(PROMPT).worker == WorkerKey(1, 0)
    d = r.find_best_match(PROMPT, candidates=[WorkerKey(2, 0), WorkerKey(7, 0)])
    assert [c.worker for c in d.candidates] == [WorkerKey(2, 0), WorkerKey(2, 1), WorkerKey(7, 0)]
    assert d.worker == WorkerKey(2, 1)
    assert d.overlaps[WorkerKey(7, 0)] == TierOverlap()
    # Only the unindexed worker: chosen, and its load counts for the next decision.
    d = r.find_best_match(PROMPT, request_id="r1", candidates=[WorkerKey(7, 0)])
    assert d.worker == WorkerKey(7, 0) and d.op is not None and d.op.overlap_tokens == 0
    assert r.load(WorkerKey(7, 0)) is not None
    other = [t + 5000 for t in PROMPT]  # shares nothing with PROMPT: the load decides
    d = r.find_best_match(other, query_only=True, candidates=[WorkerKey(7, 0), WorkerKey(8, 0)])
    assert d.worker == WorkerKey(8, 0)
    # PROMPT itself is expected on 7 now (routed there, unconfirmed): under ttft its wait
    # behind r1 beats computing it afresh on 8; under kv the two tie (r1's load there).
    d = r.find_best_match(PROMPT, query_only=True, candidates=[WorkerKey(7, 0), WorkerKey(8, 0)])
    assert d.overlaps[WorkerKey(7, 0)] == TierOverlap(expected=8)
    assert d.worker == WorkerKey(7, 0) if policy == "ttft" else d.logits[WorkerKey(7, 0)] == d.logits[WorkerKey(8, 0)]
    r.free("r1")
    # The index's own workers are untouched by what was given.
    assert r.workers() == [WorkerKey(1, 0), WorkerKey(2, 0), WorkerKey(2, 1)]
    with pytest.raises(NoEligibleWorkerError, match="no candidate"):
        r.find_best_match(PROMPT, candidates=[])


@pytest.mark.parametrize("router", [Router, ReferenceRouter], ids=["core", "reference"])
@pytest.mark.parametrize("policy", ["kv", "ttft"])
def test_replicas_routing_at_once_split_a_tie(router: type, policy: str) -> None:
    """Four replicas with the same view of eight idle workers: each breaks the tie within
    its own quarter of them in worker order (where uniform draws would send a burst to
    one worker), its own routes moving it along; a quarter with nothing tied leaves it
    every tie. Not a tie: the best wins whatever the part."""
    picks = {}
    for part in range(4):
        r = router(RouterConfig(scheduler=SchedulerConfig(policy=policy)), clock=Clock(), rng=random.Random(part))
        r.split_ties(part, 4)
        for w in (8, 3, 5, 1, 7, 2, 6, 4):  # known in another order than their ids
            r.apply_event(Cleared(w, 0, Tier.DEVICE, 0, 0))
        fresh = ([t + 7000 * (i + 1) for t in PROMPT] for i in range(3))  # cached nowhere
        picks[part] = [r.find_best_match(p, request_id=f"q{i}").worker.worker_id for i, p in enumerate(fresh)]
    for part, got in picks.items():
        assert sorted(got[:2]) == [2 * part + 1, 2 * part + 2], got
        assert got[2] not in got[:2]  # its quarter busy: any other tie
    r = router(RouterConfig(scheduler=SchedulerConfig(policy=policy)), clock=Clock(), rng=random.Random(0))
    r.split_ties(3, 4)
    for w in range(1, 9):
        r.apply_event(Cleared(w, 0, Tier.DEVICE, 0, 0))
    r.apply_event(store(2, Tier.DEVICE, 8))
    assert r.find_best_match(PROMPT).worker == WorkerKey(2, 0)
    with pytest.raises(ValueError, match="part 4 of 4"):
        r.split_ties(4, 4)
