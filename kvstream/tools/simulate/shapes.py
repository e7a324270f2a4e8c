"""Seeded traces of other reuse shapes than a chat's, in the Mooncake form (512 tokens per
hash id, timestamps in ms), so that ``kvstream bench fleet`` and ``kvstream simulate``
play them exactly as they play the conversation trace (issue 33: a router must win on
traffic it was not tuned to). Each is sized like the conversation trace's first minutes
(about 3 requests/s, prompts of ~6–30 k tokens, a few hundred output tokens):

- ``agentic``: agent loops. A few agent kinds, each with a long system prompt (tool
  definitions) that all its sessions share; a session runs many short turns, each the
  whole context so far plus a tool result and the model's last answer, seconds apart.
- ``system-prompts``: many users on few system prompts. Each request is one of four
  long system prompts and a user's own text; some users come back for a second or
  third turn minutes later.
- ``long-docs``: long documents asked many questions. Documents of 10–30 k tokens,
  popular ones (Zipf) asked again and again by different users, each question short.

Every generated id is fresh unless shared on purpose, so that the cacheable share of a
trace is what its shape makes it (``kvstream workload`` prints it).
"""

from __future__ import annotations

import heapq
import json
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import click

from kvstream.tools.simulate.errors import SimulationError
from kvstream.tools.simulate.trace import MOONCAKE_TOKENS_PER_ID, Request

ID = MOONCAKE_TOKENS_PER_ID


class _Ids:
    """Fresh hash ids, one after another."""

    def __init__(self) -> None:
        self.next = 0

    def take(self, n: int) -> list[int]:
        out = list(range(self.next, self.next + n))
        self.next += n
        return out


def _request(out: list[Request], at_s: float, ids: list[int], fresh: _Ids, rng: random.Random, osl: int) -> None:
    # The prompt ends in a partly filled block of its own, as a real prompt rarely ends on a
    # block boundary (and as in the Mooncake traces, whose ids each stand for one block's
    # text: a partial block is never some later prompt's full one).
    isl = len(ids) * ID + rng.randint(ID // 4, ID - 1)
    out.append(Request(f"r{len(out)}", round(at_s * 1000), isl, osl, (*ids, *fresh.take(1))))


def agentic(requests: int, rng: random.Random) -> list[Request]:
    ids = _Ids()
    kinds = [ids.take(rng.randint(12, 24)) for _ in range(3)]
    heap: list[tuple[float, int, list[int], int]] = []  # (due s, session, context, turns left)
    out: list[Request] = []
    t, session = 0.0, 0
    while len(out) < requests:
        # A new session about every 5 s; each runs 8-25 turns 1-5 s apart (a tool call).
        t_next = t + rng.expovariate(1 / 5.0)
        while heap and heap[0][0] <= t_next and len(out) < requests:
            due, s, context, left = heapq.heappop(heap)
            osl = rng.randint(60, 400)
            _request(out, due, context, ids, rng, osl)
            grown = context + ids.take(max(1, osl // ID + 1)) + ids.take(rng.randint(1, 3))
            if left > 1 and len(grown) < 80:
                heapq.heappush(heap, (due + rng.uniform(1.0, 5.0), s, grown, left - 1))
        t = t_next
        session += 1
        first = rng.choice(kinds) + ids.take(rng.randint(1, 3))
        heapq.heappush(heap, (t, session, first, rng.randint(8, 25)))
    return out


def system_prompts(requests: int, rng: random.Random) -> list[Request]:
    ids = _Ids()
    prompts = [ids.take(rng.randint(8, 16)) for _ in range(4)]
    weights = [0.4, 0.3, 0.2, 0.1]
    heap: list[tuple[float, list[int], int]] = []  # (due s, context, turns left)
    out: list[Request] = []
    t = 0.0
    while len(out) < requests:
        t_next = t + rng.expovariate(3.0)
        while heap and heap[0][0] <= t_next and len(out) < requests:
            due, context, left = heapq.heappop(heap)
            osl = rng.randint(100, 600)
            _request(out, due, context, ids, rng, osl)
            if left > 1:
                grown = context + ids.take(max(1, osl // ID + 1)) + ids.take(rng.randint(1, 4))
                heapq.heappush(heap, (due + rng.uniform(20.0, 90.0), grown, left - 1))
        if len(out) >= requests:
            break
        t = t_next
        system = rng.choices(prompts, weights)[0]
        turns = 1 if rng.random() < 0.6 else rng.randint(2, 3)
        heapq.heappush(heap, (t, system + ids.take(rng.randint(2, 12)), turns))
    return out[:requests]


def long_docs(requests: int, rng: random.Random) -> list[Request]:
    ids = _Ids()
    instruction = ids.take(1)
    docs = [ids.take(rng.randint(20, 60)) for _ in range(40)]
    # Zipf popularity: the first documents are asked most.
    weights = [1 / (k + 1) ** 1.1 for k in range(len(docs))]
    out: list[Request] = []
    t = 0.0
    for _ in range(requests):
        t += rng.expovariate(3.0)
        doc = rng.choices(docs, weights)[0]
        _request(out, t, instruction + doc, ids, rng, rng.randint(80, 300))
    return out


SHAPES: dict[str, Callable[[int, random.Random], list[Request]]] = {
    "agentic": agentic,
    "system-prompts": system_prompts,
    "long-docs": long_docs,
}


@dataclass(frozen=True, slots=True)
class ShapeStats:
    requests: int
    seconds: float
    mean_input_tokens: float
    #: Share of the prompts' ids seen before in the trace (an unbounded cache's hits).
    reusable_share: float


def generate_shape(name: str, requests: int, seed: int = 0) -> list[Request]:
    """``requests`` requests of the shape, in arrival order (the same for the same seed)."""
    make = SHAPES.get(name)
    if make is None:
        raise SimulationError(f"unknown trace shape {name!r}; choose from {', '.join(SHAPES)}")
    if requests < 1:
        raise SimulationError("a generated trace needs at least one request")
    out = make(requests, random.Random(seed))
    out.sort(key=lambda r: r.arrival_ms)
    return [Request(f"r{i}", r.arrival_ms, r.input_length, r.output_length, r.hash_ids) for i, r in enumerate(out)]


def stats(requests: Iterable[Request]) -> ShapeStats:
    reqs = list(requests)
    seen: set[int] = set()
    total = reused = 0
    for r in reqs:
        for h in r.hash_ids:
            total += 1
            reused += h in seen
            seen.add(h)
    span = (reqs[-1].arrival_ms - reqs[0].arrival_ms) / 1000 if reqs else 0.0
    return ShapeStats(len(reqs), span, sum(r.input_length for r in reqs) / max(len(reqs), 1),
                      reused / total if total else 0.0)


def write_mooncake(requests: Iterable[Request], path: Path) -> None:
    """The requests as a Mooncake JSONL trace (what ``--trace`` reads)."""
    with path.open("w") as f:
        for r in requests:
            f.write(json.dumps({"timestamp": round(r.arrival_ms), "input_length": r.input_length,
                                "output_length": r.output_length, "hash_ids": list(r.hash_ids)}) + "\n")


@click.command("workload")
@click.argument("shape", type=click.Choice(sorted(SHAPES)))
@click.option("--requests", default=400, show_default=True, type=click.IntRange(1))
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="Where to write the trace (Mooncake JSONL: --trace of `kvstream simulate` and `kvstream bench fleet`).")
def workload(shape: str, requests: int, seed: int, output: Path) -> None:
    """Write a generated trace of SHAPE (agent loops, many users on few system prompts,
    long documents asked many questions) and print its size and reusable share."""
    try:
        reqs = generate_shape(shape, requests, seed)
    except SimulationError as exc:
        raise click.ClickException(str(exc)) from None
    write_mooncake(reqs, output)
    s = stats(reqs)
    click.echo(f"{output}: {s.requests} requests over {s.seconds:.0f} s, mean prompt {s.mean_input_tokens:,.0f} tokens, "
               f"{s.reusable_share:.1%} of its blocks seen before (an unbounded cache's hits)")
