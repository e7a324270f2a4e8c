"""Routing policies, all over the same Router API (so the comparison is fair): each
sees the same candidates, with the same per-tier overlaps and the same load, from
``find_best_match(..., query_only=True)``; the chosen worker is then recorded in the
router's active sequences by ``find_best_match`` restricted to it, so that load tracking
is identical whichever policy chose."""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Protocol

from kvstream.router import RouteDecision, Router, SchedulerOverrides
from kvstream.router.scheduler import CandidateScore
from kvstream.tools.simulate.errors import SimulationError


class Policy(Protocol):
    name: str

    def route(self, router: Router, tokens: list[int], request_id: str) -> RouteDecision:
        """Choose a worker for the request and record it as active on the router."""
        ...


class KvPolicy:
    """This project's router: the §5 cost over per-tier prefix overlaps and load."""

    name = "kv"

    def route(self, router: Router, tokens: list[int], request_id: str) -> RouteDecision:
        return router.find_best_match(tokens, request_id=request_id)


class TtftPolicy:
    """The router's predicted-TTFT policy (kvstream.router.costs), with the throughput
    it learns from the simulated route → first token times."""

    name = "ttft"
    _overrides = SchedulerOverrides(policy="ttft")

    def route(self, router: Router, tokens: list[int], request_id: str) -> RouteDecision:
        return router.find_best_match(tokens, request_id=request_id, overrides=self._overrides)


class _Baseline(ABC):
    """A policy that ignores cache overlaps: it picks among the candidates by its own
    rule, then has the router record the request on that worker."""

    name = ""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    @abstractmethod
    def pick(self, candidates: list[CandidateScore]) -> CandidateScore: ...

    def route(self, router: Router, tokens: list[int], request_id: str) -> RouteDecision:
        query = router.find_best_match(tokens, query_only=True)
        # Sorted by worker: the router's own candidate order depends on event arrival.
        chosen = self.pick(sorted(query.candidates, key=lambda c: c.worker))
        only = SchedulerOverrides(allowed_workers=frozenset({chosen.worker.worker_id}))
        return router.find_best_match(tokens, request_id=request_id, overrides=only)


class RoundRobinPolicy(_Baseline):
    name = "round_robin"

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        self._next = 0

    def pick(self, candidates: list[CandidateScore]) -> CandidateScore:
        chosen = candidates[self._next % len(candidates)]
        self._next += 1
        return chosen


class RandomPolicy(_Baseline):
    name = "random"

    def pick(self, candidates: list[CandidateScore]) -> CandidateScore:
        return self.rng.choice(candidates)


class LeastLoadPolicy(_Baseline):
    """Fewest active requests; ties: fewest prefill tokens in flight, then fewest
    decode blocks, then a seeded random choice."""

    name = "least_load"

    def pick(self, candidates: list[CandidateScore]) -> CandidateScore:
        def load(c: CandidateScore) -> tuple[int, int, int]:
            return (c.active_requests, c.active_prefill_tokens, c.active_decode_blocks)

        best = min(load(c) for c in candidates)
        return self.rng.choice([c for c in candidates if load(c) == best])


#: Policy name → constructor taking the run's seed.
POLICIES: dict[str, Callable[[int], Policy]] = {
    "kv": lambda _seed: KvPolicy(),
    "ttft": lambda _seed: TtftPolicy(),
    "round_robin": RoundRobinPolicy,
    "random": RandomPolicy,
    "least_load": LeastLoadPolicy,
}


def make_policy(name: str, seed: int) -> Policy:
    make = POLICIES.get(name)
    if make is None:
        raise SimulationError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}")
    return make(seed)
