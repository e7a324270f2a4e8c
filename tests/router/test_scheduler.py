"""worker_logit and selection against examples computed by hand (DESIGN.md §5)."""

from __future__ import annotations

import math
import random

import pytest

from kvstream.router.errors import NoEligibleWorkerError, SchedulerConfigError
from kvstream.router.index import TierOverlap, WorkerKey
from kvstream.router.scheduler import Candidate, SchedulerConfig, SchedulerOverrides

from .reference_router import Scheduler, probabilities, worker_logit

A, B, C = WorkerKey(1, 0), WorkerKey(2, 0), WorkerKey(3, 0)


def idle(key: WorkerKey, overlap: TierOverlap, blocks: int) -> Candidate:
    return Candidate(key, overlap, False, 0, 0, 0, blocks)


def test_device_against_host_overlap_and_the_host_weight_decides() -> None:
    # isl 64 tokens = 4 blocks of 16, nobody loaded (prefill = isl/B = 4).
    # A: 2 device blocks → credit 2, prefill cost 4-2 = 2, decode 4 → logit 6.
    # B: 3 host blocks → credit 0.75·3 = 2.25, prefill cost 1.75, decode 4 → 5.75.
    a = idle(A, TierOverlap(device=2), 4)
    b = idle(B, TierOverlap(host_pinned=3), 4)
    cfg = SchedulerConfig()
    sa, sb = worker_logit(cfg, 64, 16, a), worker_logit(cfg, 64, 16, b)
    assert (sa.credit, sa.cached_tokens, sa.prefill_blocks, sa.prefill_cost) == (2, 32, 4, 2)
    assert (sb.credit, sb.cached_tokens, sb.prefill_cost, sb.decode_blocks) == (2.25, 36, 1.75, 4)
    assert (sa.logit, sb.logit) == (6, 5.75)
    sched = Scheduler(cfg, random.Random(0))
    assert sched.schedule(64, 16, [a, b]).chosen == 1
    # With host blocks worth 0.5, B's credit is 1.5: logit 2.5 + 4 = 6.5, A wins.
    sch = sched.schedule(64, 16, [a, b], SchedulerOverrides(host_cache_hit_weight=0.5))
    assert sch.chosen == 0
    assert [t.logit for t in sch.terms] == [6, 6.5]
    assert sch.config.host_cache_hit_weight == 0.5


def test_disk_and_external_share_the_disk_weight() -> None:
    # 8 blocks; C holds 1 device + 2 disk + 2 external: credit 1 + 0.25·4 = 2.
    c = idle(C, TierOverlap(device=1, disk=2, external=2), 8)
    s = worker_logit(SchedulerConfig(), 128, 16, c)
    assert (s.credit, s.cached_tokens, s.prefill_cost, s.logit) == (2, 32, 6, 14)
    s = worker_logit(SchedulerConfig(disk_cache_hit_weight=1.0), 128, 16, c)
    assert (s.credit, s.prefill_cost, s.logit) == (5, 3, 11)


def test_loaded_worker_every_term() -> None:
    # isl 64, B 16; 3 device blocks → credit 3, cached 48;
    # prefill = (100 + max(64-48, 0) + 48) / 16 = 10.25, cost 1.5·(10.25-3) = 10.875;
    # decode = 10 active + 1 new = 11; requests 2·0.5 = 1 → logit 22.875.
    c = Candidate(A, TierOverlap(device=3), True, 100, 10, 2, 1)
    cfg = SchedulerConfig(prefill_load_scale=1.5, decode_active_request_weight=0.5)
    s = worker_logit(cfg, 64, 16, c)
    assert s.prefill_blocks == 10.25
    assert s.prefill_cost == 10.875
    assert (s.decode_blocks, s.request_cost) == (11, 1.0)
    assert s.logit == 22.875


def test_cached_beyond_the_prompt_and_no_load_entry() -> None:
    # credit 2·4 = 8 blocks > isl 64/16 = 4: cached 128 tokens.
    cfg = SchedulerConfig(overlap_score_credit=2.0)
    loaded = Candidate(A, TierOverlap(device=4), True, 0, 0, 1, 0)
    s = worker_logit(cfg, 64, 16, loaded)
    assert s.cached_tokens == 128 and s.prefill_blocks == 8  # (0 + 0 + 128)/16
    assert s.prefill_cost == 0
    s = worker_logit(cfg, 64, 16, loaded._replace(has_load=False))
    assert s.prefill_blocks == 4  # isl/B without a load entry


def test_cached_tokens_round_halves_away_from_zero() -> None:
    # B 2; 1 device + 1 disk block: credit 1.25, ·2 = 2.5 → 3 (round() would give 2).
    s = worker_logit(SchedulerConfig(), 8, 2, idle(A, TierOverlap(device=1, disk=1), 4))
    assert s.cached_tokens == 3
    # B 2, credit 0.25 (1 disk block): 0.5 tokens → 1 (round() would give 0).
    assert worker_logit(SchedulerConfig(), 8, 2, idle(A, TierOverlap(disk=1), 4)).cached_tokens == 1


def test_argmin_ties_are_broken_uniformly_and_reproducibly() -> None:
    cands = [idle(A, TierOverlap(), 4), idle(B, TierOverlap(), 4), idle(C, TierOverlap(device=1), 4)]
    picks = [Scheduler(rng=random.Random(7)).schedule(64, 16, cands[:2]).chosen for _ in range(3)]
    assert len(set(picks)) == 1  # same seed, same choice
    sched = Scheduler(rng=random.Random(1))
    counts = [0, 0, 0]
    for _ in range(2000):
        counts[sched.schedule(64, 16, [cands[0], cands[1]]).chosen] += 1
    assert 850 < counts[0] < 1150 and counts[2] == 0
    sch = sched.schedule(64, 16, cands)
    # C has the lowest logit (7 against 8): it alone has probability 1.
    assert sch.probabilities == (0.0, 0.0, 1.0) and sch.chosen == 2


def test_softmax_probabilities_and_sampling() -> None:
    # p ∝ exp(-(l - 1) / ((3 - 1)·T)), T = 1: 1, e^-0.5, e^-1.
    probs = probabilities([1.0, 2.0, 3.0], 1.0)
    z = 1 + math.exp(-0.5) + math.exp(-1)
    assert probs == pytest.approx([1 / z, math.exp(-0.5) / z, math.exp(-1) / z])
    assert probabilities([5.0, 5.0], 0.5) == [0.5, 0.5]
    # Logits 4 (device 0), 3 (device 1) and 2 (device 2): T = 2 → weights e^-0.5, e^-0.25, 1.
    cands = [idle(A, TierOverlap(), 4), idle(B, TierOverlap(device=1), 4), idle(C, TierOverlap(device=2), 4)]
    sched = Scheduler(SchedulerConfig(router_temperature=2.0), random.Random(3))
    counts = [0, 0, 0]
    for _ in range(4000):
        counts[sched.schedule(64, 16, cands).chosen] += 1
    scores = sched.schedule(64, 16, cands).scores()
    expected = probabilities([s.logit for s in scores], 2.0)
    assert [s.logit for s in scores] == [8, 7, 6]
    assert [s.probability for s in scores] == pytest.approx(expected)
    for n, p in zip(counts, expected):
        assert abs(n / 4000 - p) < 0.03


def test_filters_and_the_reasons_when_nothing_is_eligible() -> None:
    a = Candidate(A, TierOverlap(device=4), True, 500, 90, 3, 0)
    b = Candidate(B, TierOverlap(), True, 10, 200, 1, 4)
    sched = Scheduler(SchedulerConfig(max_active_decode_blocks=100), random.Random(0))
    sch = sched.schedule(64, 16, [a, b])
    assert sch.chosen == 0
    assert sch.excluded == (None, "busy: 200 active decode blocks > 100")
    assert sch.probabilities == (1.0, 0.0)
    with pytest.raises(NoEligibleWorkerError, match="active prefill tokens 500|500 active prefill tokens > 100"):
        sched.schedule(64, 16, [a, b], SchedulerOverrides(max_active_prefill_tokens=100))
    with pytest.raises(NoEligibleWorkerError, match=r"allowed workers \[9\] is known"):
        sched.schedule(64, 16, [a, b], SchedulerOverrides(allowed_workers=frozenset({9})))
    sch = sched.schedule(
        64, 16, [a, b], SchedulerOverrides(allowed_workers=frozenset({2}), max_active_decode_blocks=1000)
    )
    assert sch.chosen == 1 and sch.excluded == ("not in allowed_workers", None)
    with pytest.raises(NoEligibleWorkerError, match="no workers known"):
        sched.schedule(64, 16, [])


def test_config_validation() -> None:
    with pytest.raises(SchedulerConfigError, match="host_cache_hit_weight"):
        SchedulerConfig(host_cache_hit_weight=-1)
    with pytest.raises(SchedulerConfigError, match="router_temperature"):
        SchedulerConfig().with_overrides(SchedulerOverrides(router_temperature=float("nan")))
    with pytest.raises(SchedulerConfigError, match="frozenset"):
        SchedulerConfig(allowed_workers={1, 2})  # type: ignore[arg-type]
    cfg = SchedulerConfig()
    assert cfg.with_overrides(SchedulerOverrides()) is cfg
    assert cfg.with_overrides(SchedulerOverrides(prefill_load_scale=2)).prefill_load_scale == 2
