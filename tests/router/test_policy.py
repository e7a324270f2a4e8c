"""The ttft policy (kvstream.router.costs, kvstream.router.rates; the model in tests/router/reference_router.py, checked against the core by test_core_properties): predicted time to first token from queued
prefill work, the uncached prompt, onboarding per tier and learned throughput."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstream.events.model import Cleared, Tier
from kvstream.router.active import ActiveSequences as CoreActiveSequences
from kvstream.router.active import AddRequest, PrefillDone
from kvstream.router.errors import SchedulerConfigError
from kvstream.router.explain import decision_dict
from kvstream.router.index import TierOverlap, WorkerKey
from kvstream.router.rates import PrefillRates
from kvstream.router.router import Router, RouterConfig
from kvstream.router.scheduler import Candidate, SchedulerConfig, SchedulerOverrides

from .reference_router import ActiveSequences, Candidates, Scheduler, predicted_ttft

A, B = WorkerKey(1, 0), WorkerKey(2, 0)
TTFT = SchedulerConfig(policy="ttft")


def reference_ttft(
    cfg: SchedulerConfig, isl: int, bs: int, c: Candidate, rate: float, slowdown: float = 0.0, busy: float = 0.9
) -> float:
    """The policy's formula for one candidate, written out plainly (``busy``: the share
    of candidates with a request running, at most 0.9)."""
    o = c.overlap
    ahead = c.active_prefill_tokens if c.has_load else 0
    decode = c.active_decode_blocks if c.has_load else 0
    per_token = 1 / rate + slowdown * decode
    stored = o.device + o.host_pinned + o.disk + o.external
    uncached = max(isl - (stored + cfg.expected_cache_hit_weight * o.expected) * bs, 0)
    onboard = cfg.ttft_host_onboard_ratio * o.host_pinned * bs + cfg.ttft_disk_onboard_ratio * (o.disk + o.external) * bs
    others = cfg.ttft_decode_delay_weight * (c.active_requests if c.has_load else 0) * (uncached + onboard)
    recompute = cfg.ttft_recompute_weight * busy / (1 - busy)
    return (ahead + uncached + onboard + others) * per_token + recompute * uncached * per_token


overlaps = st.builds(TierOverlap, *(st.integers(0, 20) for _ in range(5)))
candidates = st.builds(
    Candidate,
    st.builds(WorkerKey, st.integers(0, 1000), st.integers(0, 3)),
    overlaps,
    st.booleans(),
    st.integers(0, 100_000),
    st.integers(0, 5000),
    st.integers(0, 64),
    st.integers(0, 100),
)


@settings(max_examples=200, deadline=None)
@given(
    rows=st.lists(candidates, min_size=1, max_size=8),
    isl=st.integers(0, 20 * 16 * 4),
    rates=st.lists(st.floats(100, 1e6), min_size=8, max_size=8),
    host=st.floats(0, 2),
    disk=st.floats(0, 2),
    recompute=st.floats(0, 3),
    slowdown=st.sampled_from([0.0, 1e-9, 3e-7]),
)
def test_predicted_ttft_matches_the_formula(rows, isl, rates, host, disk, recompute, slowdown) -> None:
    cfg = SchedulerConfig(policy="ttft", ttft_host_onboard_ratio=host, ttft_disk_onboard_ratio=disk,
                          ttft_recompute_weight=recompute)
    base = Candidates.from_rows(rows)
    c = replace(base, rates=np.array(rates[: len(rows)]), decode_slowdown_s=slowdown)
    got = predicted_ttft(cfg, isl, 16, c)
    busy = min(sum(1 for r in rows if r.has_load) / len(rows), 0.9)
    want = [reference_ttft(cfg, isl, 16, r, rate, slowdown, busy) for r, rate in zip(rows, rates)]
    assert got == pytest.approx(want, rel=1e-9, abs=1e-12)
    # The scheduler picks a candidate of least predicted TTFT (temperature 0).
    sch = Scheduler(cfg, random.Random(0)).schedule(isl, 16, c)
    assert want[sch.chosen] == pytest.approx(min(want), rel=1e-9, abs=1e-12)
    assert sch.columns.logit.tolist() == pytest.approx([w * 1000 for w in want], rel=1e-9, abs=1e-9)


def test_a_short_prompt_is_not_parked_behind_a_long_prefill() -> None:
    """The issue's case: A holds half of a short prompt but has 30k tokens of prefill
    queued; B has no prefill queued but 100 blocks decoding. kv (§5) weighs a queued
    prefill block like a decode block (62.6 against 108) and picks A; ttft predicts
    1.56 s on A against 0.13 s on B and picks B (its cost adds the recompute weight,
    times the share of busy candidates, times each one's own uncached prefill time, and
    the delay that prefill puts on each request running there)."""
    a = Candidate(A, TierOverlap(device=2), True, 30_000, 0, 1, 2)
    b = Candidate(B, TierOverlap(), True, 0, 100, 5, 4)
    isl = 2048
    cands = Candidates.from_rows([a, b])
    kv = Scheduler(SchedulerConfig(), random.Random(0)).schedule(isl, 512, cands)
    ttft = Scheduler(TTFT, random.Random(0)).schedule(isl, 512, cands)
    assert kv.chosen == 0
    assert ttft.chosen == 1
    w = 1 + TTFT.ttft_recompute_weight * 0.9 / 0.1  # both have requests running (the share capped at 0.9)
    # Plus the delay each one's own prefill puts on the requests running there (1 and 5).
    assert ttft.columns.logit.tolist() == pytest.approx([(30_000 + w * 1024 + 1024) / 20.0, (w * 2048 + 5 * 2048) / 20.0])


def test_onboarding_costs_by_tier_and_learned_rates() -> None:
    # Same prompt, 4 blocks of 512: A has them on disk, B on host; B wins at equal rates...
    a = Candidate(A, TierOverlap(disk=4), False, 0, 0, 0, 4)
    b = Candidate(B, TierOverlap(host_pinned=4), False, 0, 0, 0, 4)
    base = Candidates.from_rows([a, b])
    sched = Scheduler(TTFT, random.Random(0))
    assert sched.schedule(2048, 512, base).chosen == 1
    # ...but not when B is known to be six times slower.
    slow_b = replace(base, rates=np.array([20_000.0, 20_000.0 / 6]))
    assert sched.schedule(2048, 512, slow_b).chosen == 0


def test_rates_are_decayed_sums_with_fallbacks() -> None:
    r = PrefillRates(alpha=0.5)
    assert r.rate(A) is None
    assert r.rates_for([A, B], prior=7.0, scope="worker") == [7.0, 7.0]
    r.observe(A, 1000, 1.0)
    assert r.rate(A) == 1000
    r.observe(A, 3000, 1.0)  # sums: tokens 0.5·1000 + 0.5·3000 = 2000, seconds 1
    assert r.rate(A) == 2000
    r.observe(A, 10, 0.0)  # no elapsed time: no information
    assert r.rate(A) == 2000
    r.observe(B, 1000, 1.0)
    assert r.rates_for([A, B, WorkerKey(9, 0)], prior=7.0, scope="worker") == [2000, 1000, 1500]
    with pytest.raises(ValueError):
        PrefillRates(alpha=0)


def test_the_fleet_scope_prices_every_worker_at_the_pooled_rate() -> None:
    r = PrefillRates(alpha=0.5)
    assert r.fleet_rate() is None
    assert r.rates_for([A, B], prior=7.0, scope="fleet") == [7.0, 7.0]
    r.observe(A, 4000, 0.2)  # 20k tokens/s
    r.observe(B, 1000, 0.1)  # 10k tokens/s
    pooled = (4000 + 1000) / (0.2 + 0.1)
    assert r.fleet_rate() == pytest.approx(pooled)
    assert r.rates_for([A, B, WorkerKey(9, 0)], prior=7.0, scope="fleet") == pytest.approx([pooled] * 3)
    assert r.rates_for([A, B], prior=7.0, scope="worker") == pytest.approx([20_000, 10_000])
    with pytest.raises(SchedulerConfigError, match="ttft_rate_scope"):
        SchedulerConfig(ttft_rate_scope="rack")


def test_the_pooled_rate_kept_as_sums_change_is_the_sum_over_the_workers() -> None:
    rng = random.Random(7)
    r = PrefillRates(alpha=0.05)
    keys = [WorkerKey(w, d) for w in range(6) for d in range(2)]
    for n in range(3000):
        r.observe(rng.choice(keys), rng.randrange(1, 40_000), rng.uniform(0.001, 3.0), rng.randrange(0, 300))
        if n % 700 == 699:
            r.forget(rng.choice(keys))
        # Each worker's rate is tokens / seconds of its sums: pooled, Σ tokens / Σ seconds.
        tokens = sum(r._sums[k][0] for k in r.keys())  # noqa: SLF001 (the sums the pooled figure must equal)
        seconds = sum(r._sums[k][1] for k in r.keys())  # noqa: SLF001
        assert r.fleet_rate() == pytest.approx(tokens / seconds, rel=1e-9), n


def test_identical_workers_look_alike_to_the_fleet_scope() -> None:
    """Two identical workers whose TTFTs carried different hidden work (one onboarded
    from disk, which dedup reports as device hits) learn different rates; priced at
    their own, a long uncached prompt goes to the one that looks faster although 20k
    tokens are queued there, priced at the fleet's it goes to the idle one."""
    learned = PrefillRates()
    for _ in range(50):
        learned.observe(A, 20_000, 1.0)
        learned.observe(B, 20_000, 1.5)
    a = Candidate(A, TierOverlap(), True, 20_000, 10, 1, 196)
    b = Candidate(B, TierOverlap(), False, 0, 0, 0, 196)
    base = Candidates.from_rows([a, b])
    isl = 100_000
    for scope, chosen in (("worker", 0), ("fleet", 1)):
        rates = np.array(learned.rates_for(base.workers, 20_000.0, scope))
        cands = replace(base, rates=rates)
        # The running request's delay apart (it alone would send the prompt to B).
        cfg = SchedulerConfig(policy="ttft", ttft_rate_scope=scope, ttft_decode_delay_weight=0.0)
        assert Scheduler(cfg, random.Random(0)).schedule(isl, 512, cands).chosen == chosen, scope


def test_recomputing_elsewhere_beats_a_cached_prefix_behind_a_long_queue_only_while_others_are_idle() -> None:
    """A holds all but one block of a 64k-token prompt behind 80k queued tokens. With
    the other seven workers idle, later requests would hardly wait behind this one's
    prefill (the busy share 1/8: a recompute weight of 1/7), so computing it on an idle
    worker (3.7 s) beats A's queue (4.1 s). With every other worker busy too, the
    recompute weight applies ninefold and A wins."""
    isl, bs = 125 * 512, 512
    rates = np.full(8, 20_000.0)
    held = Candidate(A, TierOverlap(device=124), True, 80_000, 0, 3, 1)

    def others(queued: int) -> list[Candidate]:
        return [Candidate(WorkerKey(w, 0), TierOverlap(), queued > 0, queued, 0, 1, 125) for w in range(2, 9)]

    for queued, chosen_held in ((0, False), (10_000, True)):
        rows = [held, *others(queued)]
        base = Candidates.from_rows(rows)
        c = replace(base, rates=rates)
        sch = Scheduler(TTFT, random.Random(0)).schedule(isl, bs, c)
        assert (sch.chosen == 0) is chosen_held, queued
        busy = min((1 + (7 if queued else 0)) / 8, 0.9)
        want = [reference_ttft(TTFT, isl, bs, r, 20_000.0, busy=busy) for r in rows]
        assert sch.columns.logit.tolist() == pytest.approx([w * 1000 for w in want])


def test_rates_and_the_decode_slowdown_are_learned_from_ttfts_made_by_the_model() -> None:
    """TTFTs made by ``tokens·(1/rate[w] + slowdown·decode_blocks)`` with noise, on two
    workers of different speeds: the alternating fit recovers both rates and the shared
    slowdown; with no decode load at all it learns no slowdown."""
    true = {A: 20_000.0, B: 10_000.0}
    slowdown = 2e-8  # seconds per token per decode block
    for noise, tol in ((0.0, 1e-3), (0.1, 0.25)):  # exact without noise; ~100 samples' worth with it
        rng = np.random.default_rng(0)
        r = PrefillRates(alpha=0.01)
        for _ in range(20_000):
            key = A if rng.random() < 0.5 else B
            tokens, decode = int(rng.integers(100, 50_000)), int(rng.integers(0, 400))
            seconds = tokens * (1 / true[key] + slowdown * decode) * rng.uniform(1 - noise, 1 + noise)
            r.observe(key, tokens, seconds, decode)
        assert r.rate(A) == pytest.approx(true[A], rel=max(tol, 0.02))
        assert r.rate(B) == pytest.approx(true[B], rel=max(tol, 0.02))
        assert r.decode_slowdown() == pytest.approx(slowdown, rel=tol)
    idle = PrefillRates(alpha=0.01)
    for _ in range(100):
        idle.observe(A, 1000, 0.05)
    assert idle.decode_slowdown() == 0.0 and idle.rate(A) == pytest.approx(20_000)


def test_the_models_error_is_the_decayed_relative_miss_of_its_own_predictions() -> None:
    """Each observation is predicted by the model as it stood before it (at the fleet's
    rate and at the worker's own); the error is the token-weighted decayed mean of
    |observed − predicted| / predicted."""
    r = PrefillRates(alpha=0.5)
    r.observe(A, 1000, 1.0)  # no rate before it: nothing predicted
    assert r.error("fleet") == r.error("worker") == 0.0
    r.observe(A, 1000, 1.25)  # predicted 1.0 s at 1000 tokens/s
    assert r.error("fleet") == pytest.approx(0.25) and r.error("worker") == pytest.approx(0.25)
    rate = r.rate(A)  # 1000 / 1.125
    r.observe(B, 3000, 3000 / rate)  # exactly the fleet's prediction; B has no rate of its own
    assert r.error("fleet") == pytest.approx((0.25 * 1000 * 0.25) / (0.25 * 1000 + 0.5 * 3000))
    assert r.error("worker") == pytest.approx(0.25)
    # B's own rate is now the fleet's: predicted 3000 / rate, observed twice that.
    r.observe(B, 3000, 2 * 3000 / rate)
    assert r.error("worker") == pytest.approx((0.5 * 0.5 * 1000 * 0.25 + 0.5 * 3000 * 1.0) / (0.5 * 0.5 * 1000 + 0.5 * 3000))


def test_costs_within_the_models_error_are_decided_by_the_cache() -> None:
    """A (idle, nothing cached) is predicted 204.8 ms; B holds half the prompt behind a
    queue and is predicted 4 % more. Within a 5 % error the model cannot tell them apart
    and the cache decides (B); at a 3 % error, or with the band off, the lower cost
    (A). Sampling (temperature > 0) is not narrowed."""
    a = Candidate(A, TierOverlap(), False, 0, 0, 0, 4)
    b = Candidate(B, TierOverlap(device=2), True, 2212, 0, 0, 2)
    base = replace(Candidates.from_rows([a, b]), rates=np.array([20_000.0, 20_000.0]))
    isl, bs = 2048, 512
    costs = predicted_ttft(TTFT, isl, bs, base) * 1000
    assert costs.tolist() == pytest.approx([204.8, 213.0])  # busy share 1/2: recompute weight 1
    for error, band, chosen in ((0.05, 1.0, 1), (0.03, 1.0, 0), (0.05, 0.0, 0), (0.02, 2.5, 1), (0.0, 1.0, 0)):
        cfg = replace(TTFT, ttft_error_band=band)
        sch = Scheduler(cfg, random.Random(0)).schedule(isl, bs, replace(base, rate_error=error))
        assert sch.chosen == chosen, (error, band)
        assert sch.error_band == pytest.approx(error * band)
        assert sch.columns.logit.tolist() == pytest.approx(costs.tolist())  # the costs shown are the model's
    warm = replace(TTFT, router_temperature=0.5)
    assert Scheduler(warm, random.Random(0)).schedule(isl, bs, replace(base, rate_error=0.05)).error_band == 0.0
    # Of the candidates within the band, the fewest uncached tokens first, then the lowest cost.
    c = Candidate(WorkerKey(3, 0), TierOverlap(device=2), True, 2100, 0, 0, 2)
    three = replace(Candidates.from_rows([a, b, c]), rates=np.full(3, 20_000.0), rate_error=0.1)
    assert Scheduler(TTFT, random.Random(0)).schedule(isl, bs, three).chosen == 2


def test_the_router_learns_its_error_band_from_observed_first_tokens() -> None:
    now = [100.0]
    router = Router(RouterConfig(block_size=16, scheduler=TTFT), clock=lambda: now[0], rng=random.Random(0))
    for w in (1, 2):
        router.apply_event(Cleared(w, 0, Tier.DEVICE, 0, 0))
    prompt = list(range(5000, 5000 + 16 * 8))
    assert decision_dict(router.find_best_match(prompt, query_only=True), explain=True)["error_band"] == 0.0
    for rid, worker, seconds in (("t1", 1, 1.0), ("t2", 2, 1.25)):  # 20,000 tokens each: 1 s predicted for t2
        router.find_best_match(list(range(100_000 * worker, 100_000 * worker + 20_000)), request_id=rid, overrides=_only(worker))
        now[0] += seconds
        router.prefill_done(rid)
        router.free(rid)
    assert router.learned_rates().error == pytest.approx(0.25)
    assert decision_dict(router.find_best_match(prompt, query_only=True), explain=True)["error_band"] == pytest.approx(0.25)
    wide = router.find_best_match(prompt, query_only=True, overrides=SchedulerOverrides(ttft_error_band=2.0))
    assert wide.schedule.error_band == pytest.approx(0.5)
    sampled = router.find_best_match(prompt, query_only=True, overrides=SchedulerOverrides(router_temperature=0.3))
    assert sampled.schedule.error_band == 0.0


def test_decode_load_makes_a_long_prompt_avoid_the_busier_worker() -> None:
    """Equal queued prefill and rates, no cache: without a learned slowdown the two
    workers tie; with one, the worker holding 300 decode blocks costs more per token."""
    a = Candidate(A, TierOverlap(), True, 1000, 300, 6, 200)
    b = Candidate(B, TierOverlap(), True, 1000, 20, 6, 200)
    base = Candidates.from_rows([a, b])
    rates = np.array([20_000.0, 20_000.0])
    flat = predicted_ttft(TTFT, 100_000, 512, replace(base, rates=rates))
    assert flat[0] == flat[1]
    slowed = replace(base, rates=rates, decode_slowdown_s=2e-8)
    assert Scheduler(TTFT, random.Random(0)).schedule(100_000, 512, slowed).chosen == 1
    w = 1 + TTFT.ttft_recompute_weight * 0.9 / 0.1  # both busy: the share capped at 0.9
    assert predicted_ttft(TTFT, 100_000, 512, slowed).tolist() == pytest.approx(
        [(1000 + w * 100_000 + 6 * 100_000) * (1 / 20_000 + 2e-8 * d) for d in (300, 20)]
    )


@pytest.mark.parametrize("Active", [ActiveSequences, CoreActiveSequences], ids=["reference", "core"])
def test_the_rate_is_learned_from_each_prompts_own_prefill_time(Active: type) -> None:  # noqa: N803
    """A request's prefill starts when it is routed or when the worker's previous first
    token comes, whichever is later (first come, first served): its own tokens over that
    time teach the rate, not the whole queue ahead of it, part of which was done."""
    act = Active(clock=lambda: 0.0)
    act.rates = PrefillRates(alpha=0.1)
    act.apply(AddRequest("r1", 1, 0, 4000, 0, (), 10.0))
    act.apply(AddRequest("r2", 1, 0, 2000, 1000, (), 10.1))  # r1 half done by now
    act.apply(PrefillDone("r1", 10.2))  # 4000 tokens in 0.2 s
    assert act.rates.rate(A) == pytest.approx(20_000)
    act.apply(PrefillDone("r2", 10.25))  # its 1000 from r1's first token: 0.05 s, not 0.15
    act.apply(PrefillDone("r2", 11.0))  # a repeated prefill_done teaches nothing more
    # A short prompt finishing in the chunks left beside an older long one does not
    # move the long one's start.
    act.apply(AddRequest("r3", 1, 0, 2000, 0, (), 11.0))
    act.apply(AddRequest("r4", 1, 0, 100, 0, (), 11.05))
    act.apply(PrefillDone("r4", 11.06))  # 100 tokens from its add: 0.01 s
    act.apply(PrefillDone("r3", 11.1))  # 2000 tokens from its add: 0.1 s
    tokens, seconds = 4000.0, 0.2
    for tok, sec in ((1000, 0.05), (100, 0.01), (2000, 0.1)):
        tokens, seconds = 0.9 * tokens + 0.1 * tok, 0.9 * seconds + 0.1 * sec
    assert act.rates.rate(A) == pytest.approx(tokens / seconds)
    # A prompt found whole in the cache computed nothing: no sample.
    act.apply(AddRequest("r5", 1, 0, 500, 500, (), 12.0))
    act.apply(PrefillDone("r5", 12.5))
    assert act.rates.rate(A) == pytest.approx(tokens / seconds)


def test_a_queue_counts_what_is_left_of_it() -> None:
    """ttft prices the prefill queued on a worker at what is left of it: the prompt at
    its head less what it computed at the learned rate since it could start. A holds most
    of a prompt and computes a 20,000-token one (1 s at the prior's 20k tokens/s): the
    prompt goes to idle B while that has just started, and to A once it is nearly done,
    unless another long prompt waits behind it."""
    now = [100.0]
    router = Router(RouterConfig(block_size=16, scheduler=TTFT), clock=lambda: now[0], rng=random.Random(0))
    prompt = list(range(5000, 5000 + 16 * 70))
    for w in (1, 2):
        router.apply_event(Cleared(w, 0, Tier.DEVICE, 0, 0))
    router.find_best_match(prompt[: 16 * 64], request_id="holder", overrides=_only(1))
    router.prefill_done("holder")
    router.find_best_match(list(range(50_000, 70_000)), request_id="long", overrides=_only(1))
    assert router.find_best_match(prompt, query_only=True).worker == B
    now[0] += 0.98
    d = router.find_best_match(prompt, query_only=True)
    assert d.worker == A
    # The queue's length as the load reports it is unchanged: only ttft's estimate
    # drains, and explanations show both; kv reads the whole queue and shows none.
    assert router.load(A).prefill_tokens == 20_000
    a = next(c for c in decision_dict(d, explain=True)["candidates"] if c["worker_id"] == A.worker_id)
    assert (a["active_prefill_tokens"], a["queued_prefill_tokens"]) == (20_000, pytest.approx(400))
    kv = router.find_best_match(prompt, query_only=True, overrides=SchedulerOverrides(policy="kv"))
    assert {c.queued_prefill_tokens for c in kv.candidates} == {None}
    # What waits behind the head has not started: the head's progress does not drain it.
    router.find_best_match(list(range(80_000, 90_000)), request_id="behind", overrides=_only(1))
    now[0] += 0.5  # the head overdue: 0 left of it, 10,000 behind
    assert router.find_best_match(prompt, query_only=True).worker == B
    # Its first token moves the queue on: "behind" starts then, at full length, at the
    # rate learned from "long" (20,000 tokens in 1.48 s).
    router.prefill_done("long")
    assert router.learned_rates().fleet == pytest.approx(20_000 / 1.48)
    assert router.find_best_match(prompt, query_only=True).worker == B
    now[0] += 0.98 * 10_000 / (20_000 / 1.48)  # 9,800 of its 10,000 tokens computed
    assert router.find_best_match(prompt, query_only=True).worker == A


def test_policy_config_and_per_request_override() -> None:
    with pytest.raises(SchedulerConfigError, match="policy"):
        SchedulerConfig(policy="fastest")
    with pytest.raises(SchedulerConfigError, match="ttft_prior"):
        SchedulerConfig(ttft_prior_tokens_per_s=0)
    with pytest.raises(SchedulerConfigError, match="policy"):
        SchedulerConfig().with_overrides(SchedulerOverrides(policy="nope"))
    # A router on kv, a request asking for ttft: w1 decodes a long request, w2 prefills
    # a shorter one. kv sends a short prompt to w2 (fewer blocks in all); ttft to w1.
    now = [0.0]
    router = Router(RouterConfig(block_size=4), clock=lambda: now[0], rng=random.Random(0))
    for w in (1, 2):
        router.apply_event(Cleared(w, 0, Tier.DEVICE, 0, 0))
    router.find_best_match(list(range(10_000, 14_000)), request_id="decoding", overrides=_only(1))
    now[0] = 0.2
    router.prefill_done("decoding")
    router.find_best_match(list(range(20_000, 20_600)), request_id="prefilling", overrides=_only(2))
    prompt = list(range(8))
    kv = router.find_best_match(prompt, query_only=True)
    ttft = router.find_best_match(prompt, query_only=True, overrides=SchedulerOverrides(policy="ttft"))
    assert (kv.worker.worker_id, ttft.worker.worker_id) == (2, 1)
    assert ttft.schedule.config.policy == "ttft" and kv.schedule.config.policy == "kv"
    # The router learned w1's rate from its first request: 4000 tokens in 0.2 s.
    assert router.learned_rates().per_worker[WorkerKey(1, 0)] == pytest.approx(20_000)
    # And a router configured for ttft uses it without any override.
    cfg_router = Router(RouterConfig(block_size=4, scheduler=TTFT), clock=lambda: now[0], rng=random.Random(0))
    assert cfg_router.config.scheduler.policy == "ttft"


def _only(worker: int) -> SchedulerOverrides:
    return SchedulerOverrides(allowed_workers=frozenset({worker}))
