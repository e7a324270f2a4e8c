"""The decision in the compiled core (kvstream.router.core, route.rs) against the
Python reference model (tests/router/reference_router.py): random fleets and request
sequences, plain, LoRA, salted and multimodal prompts, both policies (kv, and ttft at
the rates learned from the same ops), the same candidates, the same terms and costs
bit for bit, the same exclusion reasons and errors, the same probabilities and the same
choice for the same seed, and the same load and learned rates after every step."""

from __future__ import annotations

import array
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstream.events.model import Removed, Stored, Tier
from kvstream.hashing import MmSpan, local_hashes
from kvstream.router import Router, RouterConfig, SchedulerConfig, SchedulerOverrides, WorkerKey
from kvstream.router.core import Prompt
from kvstream.router.errors import NoEligibleWorkerError, RouterError
from kvstream.router.router import RouteDecision
from kvstream.router.scheduler import Schedule

from .reference_router import ReferenceRouter

BS = 4
#: Cache salts of stored blocks and prompts (None and "" mean none).
SALTS = (None, None, "", "tenant-a")
LORAS = (None, None, "adapter-1")
TIERS = (Tier.DEVICE, Tier.HOST_PINNED, Tier.DISK, Tier.EXTERNAL)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def conversations(rng: random.Random) -> list[list[int]]:
    """Prompts that share prefixes (a small token alphabet, branching from a trunk)."""
    trunk = [rng.randrange(3) for _ in range(BS * 10)]
    out = [trunk]
    for _ in range(4):
        base = out[rng.randrange(len(out))]
        cut = rng.randrange(len(base) + 1)
        out.append(base[:cut] + [rng.randrange(3) for _ in range(BS * rng.randrange(1, 8))])
    return out


def fleet_events(rng: random.Random, convs: list[list[int]]) -> list[object]:
    events: list[object] = []
    ids = iter(range(10**6))
    held: dict[tuple[int, int, Tier], list[int]] = {}
    for _ in range(rng.randrange(1, 25)):
        worker, rank, tier = rng.randrange(6), rng.randrange(2), rng.choice(TIERS)
        conv = rng.choice(convs)
        k = rng.randrange(1, len(conv) // BS + 1)
        hashes = tuple(next(ids) for _ in range(k))
        local = local_hashes(conv[: k * BS], BS, rng.choice(LORAS), cache_salt=rng.choice(SALTS))
        events.append(Stored(worker, rank, tier, 0, 0, None, hashes, tuple(local)))
        held.setdefault((worker, rank, tier), []).extend(hashes)
        if rng.random() < 0.2:
            w, r, t = rng.choice(list(held))
            gone = tuple(rng.sample(held[(w, r, t)], min(2, len(held[(w, r, t)]))))
            events.append(Removed(w, r, t, 0, 0, gone))
    return events


def config(rng: random.Random) -> SchedulerConfig:
    return SchedulerConfig(
        overlap_score_credit=rng.choice([1.0, 0.7, 2.0]),
        host_cache_hit_weight=rng.choice([0.75, 0.3]),
        disk_cache_hit_weight=rng.choice([0.25, 0.1]),
        prefill_load_scale=rng.choice([1.0, 0.5, 3.0]),
        decode_active_request_weight=rng.choice([0.0, 0.0, 1.5]),
        router_temperature=rng.choice([0.0, 0.0, 0.3, 1.0]),
        policy=rng.choice(["kv", "ttft"]),
        ttft_prior_tokens_per_s=rng.choice([20_000.0, 3_000.0]),
        ttft_host_onboard_ratio=rng.choice([0.1, 0.4]),
        ttft_disk_onboard_ratio=rng.choice([0.5, 0.9]),
        ttft_recompute_weight=rng.choice([0.5, 0.0, 2.0]),
        ttft_decode_delay_weight=rng.choice([1.0, 0.0, 0.3]),
        ttft_rate_scope=rng.choice(["fleet", "worker"]),
        ttft_error_band=rng.choice([1.0, 0.0, 5.0]),
        expected_cache_hit_weight=rng.choice([1.0, 1.0, 0.5, 0.0]),
    )


def mm_spans(rng: random.Random, n_tokens: int) -> list[MmSpan]:
    if rng.random() < 0.7 or n_tokens == 0:
        return []
    return [
        MmSpan(rng.randrange(2**64), off, rng.randrange(1, 2 * BS))
        for off in sorted(rng.sample(range(n_tokens), min(n_tokens, rng.randrange(1, 3))))
    ]


def overrides(rng: random.Random) -> SchedulerOverrides | None:
    roll = rng.randrange(6)
    if roll == 0:
        return SchedulerOverrides(allowed_workers=frozenset(rng.sample(range(7), 2)))
    if roll == 1:
        return SchedulerOverrides(max_active_decode_blocks=rng.randrange(0, 20), router_temperature=0.5)
    if roll == 2:
        return SchedulerOverrides(max_active_prefill_tokens=rng.randrange(0, 40))
    if roll == 3:
        return SchedulerOverrides(policy=rng.choice(["kv", "ttft"]))
    return None


def same_decision(a: RouteDecision, b: RouteDecision) -> None:
    same_schedule(a.schedule, b.schedule)
    assert (a.worker, a.isl, a.blocks, a.op) == (b.worker, b.isl, b.blocks, b.op)


def same_schedule(sa: Schedule, sb: Schedule) -> None:
    assert sa.candidates.workers == sb.candidates.workers
    assert np.array_equal(sa.candidates.overlaps, sb.candidates.overlaps)
    assert np.array_equal(sa.candidates.loads, sb.candidates.loads)
    for name, ca, cb in zip(sa.columns._fields, sa.columns, sb.columns):
        # Bit for bit: the same float64 (or int64) bytes.
        assert np.asarray(ca, np.float64).tobytes() == np.asarray(cb, np.float64).tobytes(), name
    assert sa.probabilities == sb.probabilities
    assert (sa.queued is None) == (sb.queued is None)
    if sa.queued is not None:
        assert np.asarray(sa.queued, np.float64).tobytes() == np.asarray(sb.queued, np.float64).tobytes()
    assert sa.excluded == sb.excluded
    assert sa.chosen == sb.chosen
    assert sa.config == sb.config


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1))
def test_core_decides_as_the_reference(seed: int) -> None:
    rng = random.Random(seed)
    convs = conversations(rng)
    cfg = config(rng)
    clock = Clock()
    rc = RouterConfig(block_size=BS, scheduler=cfg, request_ttl_s=50.0, expected_ttl_s=30.0, expected_blocks=rng.choice([4, 64]))
    ref = ReferenceRouter(rc, clock=clock, rng=random.Random(seed))
    core = Router(rc, clock=clock, rng=random.Random(seed))
    # One of several replicas deciding at once: a tie kept to its part of the candidates.
    parts = rng.choice([1, 2, 3, 4, 8])
    part = rng.randrange(parts)
    ref.split_ties(part, parts)
    core.split_ties(part, parts)
    for ev in fleet_events(rng, convs):
        assert ref.apply_event(ev) == core.apply_event(ev)  # type: ignore[arg-type]
    active: list[str] = []
    given: set[WorkerKey] = set()
    for step in range(40):
        roll = rng.randrange(10)
        if roll < 6:
            conv = rng.choice(convs)
            prompt = conv[: rng.randrange(len(conv) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(6))]
            rid = f"r{step}" if rng.random() < 0.8 else None
            query_only = rng.random() < 0.15
            ov = overrides(rng)
            # The gateway's candidates: some known workers' ranks, and workers with no event yet.
            cands = None if rng.random() < 0.7 else [
                WorkerKey(w, r) for w, r in rng.sample([(w, r) for w in range(9) for r in (0, 1)], rng.randrange(4))
            ]
            given.update(cands or ())
            how = {"lora_name": rng.choice(LORAS), "cache_salt": rng.choice(SALTS), "mm": mm_spans(rng, len(prompt))}
            try:
                want = ref.find_best_match(prompt, request_id=rid, query_only=query_only, overrides=ov, candidates=cands, **how)
            except RouterError as exc:
                with pytest.raises(type(exc)) as got_exc:
                    core.find_best_match(prompt, request_id=rid, query_only=query_only, overrides=ov, candidates=cands, **how)
                assert str(got_exc.value) == str(exc)
                if isinstance(exc, NoEligibleWorkerError):
                    # The core draws its uniform before knowing none is eligible; the
                    # reference draws none: realign the streams.
                    ref.reseed(step)
                    core.reseed(step)
                continue
            got = core.find_best_match(prompt, request_id=rid, query_only=query_only, overrides=ov, candidates=cands, **how)
            same_decision(want, got)
            if want.op is not None:
                active.append(want.op.request_id)
                if rng.random() < 0.3:
                    # replay explain's decision: a logged request's length and sequence hashes.
                    seqs = tuple(want.op.sequence_hashes)
                    ref.reseed(step)
                    core.reseed(step)
                    logged = core.decide_logged(want.isl, want.op.sequence_hashes, rid, clock.now, candidates=cands)
                    same_schedule(ref.schedule_hashes(want.isl, seqs, seqs, None, clock.now, candidates=cands), logged.schedule)
                    assert (logged.op, logged.blocks) == (None, len(seqs))
        elif roll < 8 and active:
            rid = active.pop(rng.randrange(len(active))) if roll == 7 else rng.choice(active)
            refuted = rng.random() < 0.5
            for r in (ref, core):
                try:
                    if roll == 7:
                        r.free(rid, refuted)
                    else:
                        r.prefill_done(rid)
                except RouterError:
                    pass  # expired meanwhile: both must say so (checked by the state below)
        elif roll == 8:
            clock.now += rng.choice([0.001, 0.01, 1.0, 20.0, 60.0])  # small: queues part drained
        elif rng.random() < 0.3:
            w = rng.randrange(6)
            if ref.knows(w):
                assert ref.remove_worker(w) == core.remove_worker(w)
        assert ref.active_requests() == core.active_requests()
        ref.index.expire_expected(clock.now)
        assert ref.index.expected_counts() == core.expected_blocks()
        for key in {*ref.workers(), *given}:
            assert ref.load(key) == core.load(key)
        # The ttft policy's learned rates are folded from the same ops.
        assert ref.learned_rates() == core.learned_rates()


def test_buffer_bytes_and_list_prompts_decide_alike() -> None:
    rng = random.Random(7)
    convs = conversations(rng)
    r = Router(RouterConfig(block_size=BS), rng=random.Random(1))
    for ev in fleet_events(rng, convs):
        r.apply_event(ev)  # type: ignore[arg-type]
    prompt = convs[1] + [1, 2]
    forms = [
        prompt,
        np.array(prompt, dtype=np.uint32),
        array.array("I", prompt),
        np.array(prompt, dtype="<u4").tobytes(),
        memoryview(bytearray(np.array(prompt, dtype="<u4").tobytes())),
    ]
    decisions = []
    for form in forms:
        r.reseed(3)
        decisions.append(r.find_best_match(form))
    for d in decisions[1:]:
        same_decision(decisions[0], d)


@pytest.mark.parametrize(
    ("tokens", "reason"),
    [
        (b"\x01\x00\x00\x00\x02", "not a multiple of 4"),
        ([1, -2, 3], "[0, 2**32)"),
        ([1, 2**32], "[0, 2**32)"),
        ([1, "x"], "[0, 2**32)"),
        (np.array([1, 2], dtype=np.float64), "[0, 2**32)"),
    ],
)
def test_bad_prompts_are_rejected_with_the_reason(tokens: object, reason: str) -> None:
    r = Router(RouterConfig(block_size=BS))
    r.apply_event(Stored(1, 0, Tier.DEVICE, 0, 0, None, (1,), tuple(local_hashes([0, 0, 0, 0], BS))))
    with pytest.raises(ValueError, match=reason.replace("[", r"\[").replace("*", r"\*").replace("(", r"\(").replace(")", r"\)")):
        r.find_best_match(tokens, request_id="x")  # type: ignore[arg-type]
    assert not r.is_active("x") and r.active_requests() == 0  # nothing applied


def test_prompt_over_the_token_cap_is_rejected() -> None:
    r = Router(RouterConfig(block_size=BS))
    r.apply_event(Stored(1, 0, Tier.DEVICE, 0, 0, None, (1,), tuple(local_hashes([0, 0, 0, 0], BS))))
    with pytest.raises(ValueError, match="exceeds the limit of 8"):
        r._decide(Prompt(bytes(4 * 9)), "x", "x", None, None, max_tokens=8)
    assert r.active_requests() == 0
