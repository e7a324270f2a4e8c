"""Predicted blocks (issue 33): a routed prompt's blocks are expected on its worker until
the engine's events confirm them, its request is refuted, or their TTL runs out; they
are shared by the ADD ops every replica folds, refuted by a FREE's flag (a v1 reader
and writer still interoperate), and bounded by each rank's capacity whatever the flood
of routes. The rules themselves are checked against the reference model in
test_index_properties.py and test_core_properties.py."""

from __future__ import annotations

import random

from kvstream.events.codec import AvroCodec
from kvstream.events.model import Stored, Tier
from kvstream.events.schemas import SchemaStore
from kvstream.hashing import block_hashes
from kvstream.replica.active_codec import ACTIVE_OP, ActiveOpCodec
from kvstream.router import Router, RouterConfig, SchedulerConfig, WorkerKey
from kvstream.router.active import FreeRequest
from kvstream.router.index import TieredIndex, TierOverlap

A, B = WorkerKey(1, 0), WorkerKey(2, 0)
PROMPT = list(range(500, 500 + 16 * 6))  # 6 blocks of 16


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def router(clock: Clock, **config: object) -> Router:
    return Router(RouterConfig(**config), clock=clock, rng=random.Random(0))  # type: ignore[arg-type]


def test_a_routed_prompt_is_expected_until_its_blocks_are_stored() -> None:
    clock = Clock()
    r = router(clock)
    d = r.find_best_match(PROMPT, request_id="r1", candidates=[A, B])
    chosen = d.worker
    assert r.expected_blocks() == {chosen: 6}
    # The next request with the prompt sees it on that worker, apart from stored blocks.
    again = r.find_best_match(PROMPT, query_only=True, candidates=[A, B])
    assert again.overlaps[chosen] == TierOverlap(expected=6)
    # The engine stores the first four: those are the index's now, the rest still expected.
    local, seq = block_hashes(PROMPT)
    r.apply_event(Stored(chosen.worker_id, 0, Tier.DEVICE, 0, 0, None, tuple(seq[:4]), tuple(local[:4])))
    assert r.expected_blocks() == {chosen: 2}
    assert r.find_best_match(PROMPT, query_only=True, candidates=[A, B]).overlaps[chosen] == TierOverlap(4, expected=2)


def test_a_refuted_request_takes_its_prediction_back_a_finished_one_does_not() -> None:
    clock = Clock()
    r = router(clock)
    first = r.find_best_match(PROMPT, request_id="ok", candidates=[A]).worker
    r.free("ok")  # finished: its blocks are in the engine's cache, the events will say so
    assert r.expected_blocks() == {first: 6}
    r.find_best_match(PROMPT + list(range(9000, 9016)), request_id="bad", candidates=[B])
    assert r.expected_blocks() == {A: 6, B: 7}
    r.free("bad", refuted=True)  # failed before its first token: B computed nothing
    assert r.expected_blocks() == {A: 6}


def test_a_refuted_request_keeps_what_another_running_request_predicts() -> None:
    r = router(Clock())
    r.find_best_match(PROMPT, request_id="one", candidates=[A])
    r.find_best_match(PROMPT[:64], request_id="two", candidates=[A])
    r.free("one", refuted=True)
    assert r.expected_blocks() == {A: 4}  # "two" still runs with the first four blocks


def test_predictions_expire_after_their_ttl_in_log_time() -> None:
    clock = Clock()
    r = router(clock, expected_ttl_s=30.0)
    r.find_best_match(PROMPT, request_id="r1", candidates=[A])
    clock.now += 30.0
    assert r.expected_blocks() == {A: 6}
    clock.now += 0.001
    assert r.expected_blocks() == {}
    assert r.find_best_match(PROMPT, query_only=True, candidates=[A]).overlaps[A] == TierOverlap()


def test_a_new_incarnation_drops_what_its_worker_was_expected_to_hold() -> None:
    r = router(Clock())
    r.find_best_match(PROMPT, request_id="r1", candidates=[A])
    r.apply_event(Stored(1, 0, Tier.DEVICE, 0, 0, None, (77,), (block_hashes(list(range(16)))[0][0],)))
    assert r.expected_blocks() == {A: 6}
    r.clear_worker(1)
    assert r.expected_blocks() == {}


def test_a_worker_whose_events_stop_keeps_its_predictions() -> None:
    """The lease ran out: its stored blocks go; what was routed there stays, and what it
    held on the device becomes expected as of the expiry (routed by them alone:
    approximate mode) until the TTL."""
    clock = Clock()
    r = router(clock, expected_ttl_s=60.0)
    local, seq = block_hashes(PROMPT)
    r.apply_event(Stored(1, 0, Tier.DEVICE, 0, 0, None, tuple(seq[:2]), tuple(local[:2])))
    r.find_best_match(PROMPT, request_id="r1", candidates=[A])
    r.remove_worker(1, "expired", demote_at=clock.now + 10)
    assert not r.knows(1)
    assert r.find_best_match(PROMPT, query_only=True, candidates=[A, B]).overlaps[A] == TierOverlap(expected=6)
    clock.now += 60.5  # the routed blocks' TTL is over, the demoted ones' not yet
    assert r.find_best_match(PROMPT, query_only=True, candidates=[A, B]).overlaps[A] == TierOverlap(expected=2)
    # Without a demotion (a worker that left), only what was routed stays.
    r.find_best_match(PROMPT, request_id="r2", candidates=[B])
    r.apply_event(Stored(2, 0, Tier.DEVICE, 0, 0, None, tuple(seq[:2]), tuple(local[:2])))
    r.remove_worker(2, "gone")
    assert r.expected_blocks()[B] == 4


def test_a_peers_ops_predict_and_refute_alike() -> None:
    """Replica 2 folds replica 1's ADD and refuted FREE through the active record."""
    clock = Clock()
    one, two = router(clock), router(clock)
    codec = ActiveOpCodec()
    d = one.find_best_match(PROMPT, request_id="r1/x", candidates=[A])
    assert d.op is not None
    two.apply_active(codec.decode(codec.encode("r1", d.op))[1])
    assert two.expected_blocks() == one.expected_blocks() == {A: 6}
    two.apply_active(codec.decode(codec.encode("r1", one.free("r1/x", refuted=True)))[1])
    assert two.expected_blocks() == one.expected_blocks() == {}


def test_a_v1_reader_and_writer_interoperate_with_v2() -> None:
    """A replica of the previous release (ActiveOp v1) writes frees without the flag: they
    are not refutations; and reads a v2 free as a plain free."""
    v1 = AvroCodec(SchemaStore(pins={ACTIVE_OP: 1}))
    old, new = ActiveOpCodec(v1), ActiveOpCodec()
    free = FreeRequest("r1/x", 1000.0, refuted=True)
    assert new.decode(old.encode("r1", free)) == ("r1", FreeRequest("r1/x", 1000.0, refuted=False))
    assert old.decode(new.encode("r1", free)) == ("r1", FreeRequest("r1/x", 1000.0, refuted=False))
    assert new.decode(new.encode("r1", free)) == ("r1", free)


def test_a_flood_of_never_ending_routes_stays_within_the_workers_capacities() -> None:
    """Routes for requests that never complete (never confirmed, never freed): what a
    replica expects stays within the ranks' device capacities (and a default for a rank
    whose capacity is unknown), and so does the memory holding it."""
    clock = Clock()
    r = router(clock, expected_blocks=500, scheduler=SchedulerConfig(router_temperature=1.0))
    r.set_expected_capacity(1, [0], 300)
    rng = random.Random(1)
    candidates = [A, B, WorkerKey(3, 0)]
    for i in range(3000):
        clock.now += 0.01
        prompt = [rng.randrange(1, 100_000) for _ in range(16 * 32)]
        r.find_best_match(prompt, request_id=f"r{i}", candidates=candidates)
    counts = r.expected_blocks()
    assert counts[A] == 300 and counts[B] == counts[WorkerKey(3, 0)] == 500
    assert r.expected_total() == 1300


def test_the_expectations_memory_is_bounded_by_the_capacities() -> None:
    index = TieredIndex(expected_ttl_s=3600.0, expected_blocks=2000)
    rng = random.Random(2)

    def flood(n: int) -> int:
        for _ in range(n):
            _, seq = block_hashes([rng.randrange(1, 100_000) for _ in range(16 * 64)])
            index.expect(A, seq, 1000.0)
        return index.heap_bytes()

    filled = flood(100)  # 6,400 routed blocks: the 2,000 kept
    later = flood(2000)  # 128,000 more
    assert index.expected_total() == 2000
    assert later <= 1.5 * filled
    assert later < 2000 * 200  # under 200 bytes per expected block, whatever was routed
