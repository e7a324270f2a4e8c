"""The scheduler and its prefix cache against a reference built only from the KV events
they publish: the events, folded as a consumer folds them (each block as the token prefix
its parent chain spells, copies counted), predict every ``cached_tokens`` the engine
reports, and nothing is ever removed that was not stored. Property-tested over random prompts sharing
prefixes, concurrent requests, a small G1 (evictions, preemptions), with and without a
host tier behind it."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvstream.emulator.blocks import BlockPool, HostTier
from kvstream.emulator.kv_wire import AllBlocksCleared, BlockRemoved, BlockStored
from kvstream.emulator.scheduler import EngineRequest, Scheduler
from kvstream.engine_model.costs import CostModel

BS = 4


class Reference:
    """What a consumer of the events knows: each hash's full token prefix (its parent
    chain), and how many copies of it the engine holds (vLLM stores a block computed
    twice twice, and announces each copy's eviction)."""

    def __init__(self) -> None:
        self.prefix: dict[int, tuple[int, ...]] = {}
        self.copies: dict[int, int] = {}
        #: The host tier's hashes (its events name blocks by hash only).
        self.host: set[int] = set()

    def fold(self, events: list) -> None:
        for e in events:
            if isinstance(e, BlockStored) and e.medium == "CPU":
                assert e.block_size == 0 and e.token_ids == [] and e.parent_block_hash is None
                assert set(e.block_hashes) <= self.prefix.keys(), "a host block G1 never announced"
                assert not self.host & set(e.block_hashes), "stored on the host twice"
                self.host.update(e.block_hashes)
            elif isinstance(e, BlockRemoved) and e.medium == "CPU":
                assert set(e.block_hashes) <= self.host, "removed a host block never stored"
                self.host.difference_update(e.block_hashes)
            elif isinstance(e, BlockStored):
                before = () if e.parent_block_hash is None else self.prefix[e.parent_block_hash]
                assert len(e.token_ids) == len(e.block_hashes) * e.block_size
                for i, h in enumerate(e.block_hashes):
                    before = before + tuple(e.token_ids[i * BS:(i + 1) * BS])
                    assert self.prefix.setdefault(h, before) == before, "one hash, two prefixes"
                    self.copies[h] = self.copies.get(h, 0) + 1
            elif isinstance(e, BlockRemoved):
                for h in e.block_hashes:
                    assert self.copies.get(h, 0) > 0, "removed a block never stored"
                    self.copies[h] -= 1
            else:
                assert isinstance(e, AllBlocksCleared)
                self.copies.clear()

    def predicted_hit(self, prompt: list[int]) -> int:
        """G1's chain, then its continuation on the host tier."""
        held = {self.prefix[h] for h, n in self.copies.items() if n > 0}
        on_host = {self.prefix[h] for h in self.host}
        k = 0
        while k < (len(prompt) - 1) // BS and tuple(prompt[:(k + 1) * BS]) in held:
            k += 1
        while k < (len(prompt) - 1) // BS and tuple(prompt[:(k + 1) * BS]) in on_host:
            k += 1
        return k * BS


def fold_step(s: Scheduler, ref: Reference) -> None:
    ref.fold(s.pool.take_events() + (s.host.take_events() if s.host is not None else []))


def run_until_idle(s: Scheduler, ref: Reference) -> None:
    while s.has_work:
        step = s.schedule()
        s.complete(step)
        fold_step(s, ref)


stems = st.lists(st.integers(0, 3), min_size=0, max_size=12)  # a few tokens: prompts share prefixes
prompts = st.tuples(st.sampled_from([(), (7,) * 8, (7,) * 8 + (5,) * 4, (9,) * 12]), stems).map(
    lambda t: list(t[0]) + t[1]).filter(lambda p: len(p) >= 1)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(prompts, st.integers(1, 9)), min_size=1, max_size=12),
       st.integers(6, 20), st.integers(5, 16), st.sampled_from([0, 3, 12]))
def test_events_predict_cached_tokens_one_at_a_time(reqs: list[tuple[list[int], int]], blocks: int,
                                                   budget: int, host: int) -> None:
    s = Scheduler(BlockPool(blocks, BS), CostModel(batch_limit=4, max_batch_tokens=budget, min_step_ms=0),
                  HostTier(host) if host else None)
    ref = Reference()
    for i, (prompt, out) in enumerate(reqs):
        if (len(prompt) + out + BS - 1) // BS > blocks:
            continue  # longer than G1: vLLM refuses such a model length at start-up
        expected = ref.predicted_hit(prompt)
        req = EngineRequest(str(i), prompt, out, 0.0)
        s.add(req)
        run_until_idle(s, ref)
        assert req.cached_tokens == expected and req.num_output == out


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(prompts, st.integers(1, 9)), min_size=1, max_size=12),
       st.integers(8, 20), st.integers(5, 16), st.integers(1, 4), st.sampled_from([0, 3, 12]))
def test_concurrent_requests_keep_the_events_true(reqs: list[tuple[list[int], int]], blocks: int, budget: int,
                                                  batch: int, host: int) -> None:
    s = Scheduler(BlockPool(blocks, BS), CostModel(batch_limit=batch, max_batch_tokens=max(budget, batch + 1),
                                                   min_step_ms=0), HostTier(host) if host else None)
    ref = Reference()
    live = [EngineRequest(str(i), p, out, 0.0) for i, (p, out) in enumerate(reqs)
            if (len(p) + out + BS - 1) // BS <= blocks]
    for i, req in enumerate(live):
        s.add(req)
        if i % 3 == 2:  # arrivals between steps
            step = s.schedule()
            s.complete(step)
            fold_step(s, ref)
    run_until_idle(s, ref)
    assert all(r.finished and r.num_output == r.max_tokens for r in live)
    assert s.pool.free_blocks == blocks  # every block released
    for j, req in enumerate(live):  # the events still describe the cache exactly
        probe = EngineRequest(f"probe{j}", req.prompt, 1, 0.0)
        expected = ref.predicted_hit(req.prompt)
        s.add(probe)
        run_until_idle(s, ref)
        assert probe.cached_tokens == expected
