"""A seeded generator of workloads with shared prefixes, for when no trace is given
(tests, demos): system prompts shared by groups of sessions, and multi-turn sessions
whose every turn repeats the whole conversation so far. It emits trace-form requests
(``hash_ids`` per ``tokens_per_id`` tokens), so that a generated workload and a trace
take the same path through the simulator."""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass

from kvstream.tools.simulate.errors import SimulationError
from kvstream.tools.simulate.trace import Request


@dataclass(frozen=True, slots=True)
class WorkloadOptions:
    seed: int = 0
    sessions: int = 40
    #: Distinct system prompts; each session uses one of them.
    system_prompts: int = 4
    system_prompt_ids: int = 8
    turns_min: int = 1
    turns_max: int = 6
    #: Ids of new user text per turn, and output tokens per turn.
    user_ids_min: int = 1
    user_ids_max: int = 6
    output_min: int = 16
    output_max: int = 256
    #: Mean seconds between session starts, and between a session's turns.
    session_gap_s: float = 0.5
    think_time_s: float = 5.0
    tokens_per_id: int = 64

    def __post_init__(self) -> None:
        for name in ("sessions", "system_prompts", "system_prompt_ids", "turns_min", "user_ids_min",
                     "output_min", "tokens_per_id"):
            if getattr(self, name) <= 0:
                raise SimulationError(f"workload option {name} must be positive")
        if self.turns_max < self.turns_min or self.user_ids_max < self.user_ids_min or self.output_max < self.output_min:
            raise SimulationError("workload option ranges must have max >= min")
        if self.session_gap_s <= 0 or self.think_time_s <= 0:
            raise SimulationError("session_gap_s and think_time_s must be positive")


def generate(options: WorkloadOptions | None = None) -> list[Request]:
    """The requests of the workload, in arrival order (the same for the same options)."""
    o = options or WorkloadOptions()
    rng = random.Random(o.seed)
    next_id = 0

    def fresh(n: int) -> list[int]:
        nonlocal next_id
        ids = list(range(next_id, next_id + n))
        next_id += n
        return ids

    prompts = [fresh(o.system_prompt_ids) for _ in range(o.system_prompts)]
    # (arrival s, session, turn, history ids) — turns are generated lazily in time order.
    heap: list[tuple[float, int, int, list[int]]] = []
    t = 0.0
    turns_of: list[int] = []
    for s in range(o.sessions):
        t += rng.expovariate(1 / o.session_gap_s)
        turns_of.append(rng.randint(o.turns_min, o.turns_max))
        heapq.heappush(heap, (t, s, 0, list(rng.choice(prompts))))
    out: list[Request] = []
    while heap:
        at, s, turn, history = heapq.heappop(heap)
        ids = history + fresh(rng.randint(o.user_ids_min, o.user_ids_max))
        osl = rng.randint(o.output_min, o.output_max)
        # The last id is only partly filled, as a real prompt rarely ends on a boundary.
        isl = (len(ids) - 1) * o.tokens_per_id + rng.randint(1, o.tokens_per_id)
        out.append(Request(f"r{len(out)}", at * 1000, isl, osl, tuple(ids), o.tokens_per_id))
        if turn + 1 < turns_of[s]:
            # The answer joins the history (its ids are new text, one per tokens_per_id).
            answer = fresh(max(1, osl // o.tokens_per_id))
            heapq.heappush(heap, (at + rng.expovariate(1 / o.think_time_s), s, turn + 1, ids + answer))
    return out
