"""The routing decision in the compiled core (kvstream/_native_src/src/route.rs): the seam.

:func:`decide` makes one decision in one call: hashing (or the caller's local hashes),
matching across tiers, the load, the §5 terms, the policy's cost, the filters with their
reasons, the choice, and the add of a tracked request, with the GIL released while it
works. The uniform draw is taken from the router's seeded ``random.Random`` here and
handed to the core. tests/router/reference_router.py is the reference model; the
property tests (tests/router/test_core_properties.py) check this against it: same
candidates, same terms and costs bit for bit, same reasons, same choice for the same seed.

Like the rest of the router, this is not for concurrent use: callers serialize access
(the replica holds its router lock around every call). While the GIL is released the
decision holds pyo3 borrows of the index and load cores, so an unserialized writer gets
pyo3's "already borrowed" RuntimeError, never a torn state.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvstream.router.active import ActiveSequences, PackedHashes
from kvstream.router.costs import COSTS
from kvstream.router.errors import DuplicateRequestError, NoEligibleWorkerError
from kvstream.router.index import TieredIndex, WorkerKey
from kvstream.router.scheduler import Candidates, LogitColumns, Schedule, SchedulerConfig

#: A prompt: a list of ints, a buffer of native u32 (numpy uint32, array('I')), or
#: packed little-endian u32 bytes (bytes / bytearray / memoryview, e.g. an HTTP body).
PromptTokens = Sequence[int] | bytes | bytearray | memoryview | np.ndarray


@dataclass(frozen=True, slots=True)
class Prompt:
    """What a decision is about: token ids and how to hash them, or (a logged request,
    whose log keeps no token ids) its length and sequence hashes."""

    tokens: PromptTokens | None = None
    #: Seed of the local hashes (kvstream.hashing.identity_seed: adapter, cache salt).
    seed: int = 0
    #: The local hashes when the caller computed them (multimodal or extra-token
    #: blocks: kvstream.hashing.local_hashes); None: the core hashes the tokens.
    local: Sequence[int] | None = None
    #: A logged request: its length in tokens and its sequence hashes.
    isl: int = 0
    sequence_hashes: Sequence[int] | bytes | None = None


def decide(
    index: TieredIndex,
    active: ActiveSequences,
    rng: random.Random,
    cfg: SchedulerConfig,
    block_size: int,
    prompt: Prompt,
    request_id: str | None,
    now: float,
    candidates: Sequence[WorkerKey] | None = None,
    max_tokens: int | None = None,
    split: tuple[int, int] = (0, 1),
) -> tuple[Schedule, PackedHashes | None, int]:
    """One decision in the core: (schedule, the prompt's sequence hashes when the
    request was added as ``request_id``, prompt length in tokens). ``candidates`` as
    in Router.find_best_match (None: every worker the index knows); ``split``: this
    router's part of a tie (Router.split_ties).

    Raises NoEligibleWorkerError (saying why), DuplicateRequestError, ValueError (bad
    token ids or a binary body that is not whole u32s).
    """
    if request_id is not None and request_id in active:
        raise DuplicateRequestError(f"request {request_id!r} is already active")
    slots = index.candidate_slots(candidates)
    keys = [k for k in slots if k is not None]
    if not keys:
        if candidates is None:
            raise NoEligibleWorkerError("no workers known: none has published an event within its lease")
        raise NoEligibleWorkerError("no candidate worker was given")
    learned = COSTS[cfg.policy].inputs(active.rates, keys, cfg)
    # Sampling (temperature > 0) tells no costs apart: the band is for the argmin.
    band = cfg.ttft_error_band * learned.error if learned is not None and cfg.router_temperature == 0 else 0.0
    rates = None if learned is None else (learned.rates, learned.decode_slowdown_s, band)
    core, index_core = active.core, index.core
    if prompt.sequence_hashes is None:
        routed = core.route(
            index_core, slots, prompt.tokens, block_size, prompt.seed, cfg, rng.random(), now, request_id,
            prompt.local, rates, max_tokens if max_tokens is not None else 2**63, split,
        )
    else:
        routed = core.route_hashes(
            index_core, slots, prompt.isl, prompt.sequence_hashes, block_size, cfg, rng.random(), now, rates, split
        )
    chosen, ov, ld, cols, probs, queued, seqs, isl, excluded, why_none = routed
    if chosen is None:
        raise NoEligibleWorkerError(why_none)
    n = len(keys)
    c = np.frombuffer(cols, "<f8").reshape(7, n)
    cands = Candidates(
        tuple(keys),
        np.frombuffer(ov, "<i8").reshape(n, 5),
        np.frombuffer(ld, "<i8").reshape(n, 5),
    )
    columns = LogitColumns(c[0], c[1], c[2], c[3], c[4].astype(np.int64), c[5], c[6])
    schedule = Schedule(
        cands, columns, tuple(np.frombuffer(probs, "<f8").tolist()),
        (None,) * n if excluded is None else tuple(excluded), chosen, cfg,
        None if queued is None else np.frombuffer(queued, "<f8"), band,
    )
    return schedule, (PackedHashes(seqs) if seqs is not None else None), isl
