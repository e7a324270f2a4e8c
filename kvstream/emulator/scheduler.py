"""vLLM v1's scheduler, one step at a time, over the emulated G1 (kvstream.emulator.blocks).

A step has a token budget (``--max-num-batched-tokens``). Running requests come first:
decoding ones take one token each, then partly prefilled prompts take the next chunk of
theirs; then waiting requests are admitted first come first served while the budget, the
batch limit (``--max-num-seqs``) and free blocks allow, each looking up its cached prefix
(at least the last prompt token is computed: it makes the first output token), and with a
host tier (``--num-cpu-blocks``) the continuation held there is loaded instead of
computed, at the cost model's onboarding cost per token; a disaggregated decode leg
receives the rest of its prompt's KV from the prefill engine, at the cost model's
transfer cost per token, and computes only the last prompt token. Blocks are
cached (prompt and output blocks alike) when the step that computes them is scheduled, as
vLLM caches them. A running request that cannot get a block preempts the newest running
one (its blocks are freed, it waits again at the head of the queue, as vLLM's recompute
preemption). The step's time is the cost model's (kvstream.engine_model.costs): prefilled
tokens, loaded tokens, decoding requests and their context. When only decodes run and nothing waits, several steps are taken at once, up to
the first that needs a block or finishes a request (``decode_steps``): the same times,
fewer wake-ups.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from kvstream.emulator.blocks import BlockPool, HostTier, block_hash
from kvstream.engine_model.costs import CostModel

#: The token id of every output token (output is a placeholder; its length is the point).
PLACEHOLDER_TOKEN = 0


@dataclass(slots=True, eq=False)
class EngineRequest:
    """A request inside the engine (times are ``time.monotonic()`` seconds)."""

    request_id: str
    prompt: list[int]
    max_tokens: int
    arrival: float
    cache_salt: str | None = None
    #: The prompt's KV comes from a prefill engine (a disaggregated decode leg): what the
    #: caches lack is received at admission, not computed (once: a preempted request
    #: computes it again, as vLLM clears ``do_remote_prefill`` after the transfer).
    receive_kv: bool = False
    hashes: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    num_output: int = 0
    num_computed: int = 0
    #: Blocks of ``blocks`` already cached (hashed and registered).
    num_cached_blocks: int = 0
    #: Prompt tokens found in the prefix cache (G1, then the host tier) when first
    #: scheduled (usage.cached_tokens, as vLLM counts local and external hits).
    cached_tokens: int | None = None
    first_token: float | None = None
    finished: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + self.num_output

    def token_slice(self, start: int, end: int) -> list[int]:
        p = len(self.prompt)
        if end <= p:
            return self.prompt[start:end]
        return self.prompt[start:p] + [PLACEHOLDER_TOKEN] * (end - max(start, p)) if start < p \
            else [PLACEHOLDER_TOKEN] * (end - start)


@dataclass(frozen=True, slots=True)
class Step:
    """A scheduled step: (request, tokens) pairs, how many decode steps it stands for
    (1 unless only decodes run), and its time in cost-model milliseconds per step count
    (``ms(k)``: the time of the first ``k`` of ``steps``)."""

    work: tuple[tuple[EngineRequest, int], ...]
    steps: int
    prefill_tokens: int
    decoding: int
    context: int
    #: Loading the admitted requests' blocks from the host tier, receiving them from a
    #: prefill engine.
    onboard_ms: float = 0.0

    def ms(self, cost: CostModel, steps: int | None = None) -> float:
        k = self.steps if steps is None else steps
        if self.prefill_tokens or self.steps == 1:
            return cost.step_ms(self.prefill_tokens, self.decoding, self.context, self.onboard_ms)
        return cost.decode_steps_ms(k, self.decoding, self.context)


@dataclass(frozen=True, slots=True)
class StepOutput:
    """What a finished step produced: requests with new output tokens, finished ones."""

    advanced: tuple[tuple[EngineRequest, int], ...]
    finished: tuple[EngineRequest, ...]
    #: Prompt tokens looked up and found in G1, and in the host tier, by requests first
    #: scheduled (vLLM's prefix cache and external prefix cache counters), and prompt
    #: tokens received from a prefill engine.
    queried: int
    hit: int
    host_hit: int
    received: int


class Scheduler:
    def __init__(self, pool: BlockPool, cost: CostModel, host: HostTier | None = None) -> None:
        self.pool = pool
        self.cost = cost
        self.host = host
        self.bs = pool.block_size
        self.waiting: deque[EngineRequest] = deque()
        self.running: list[EngineRequest] = []
        self._queried = 0
        self._hit = 0
        self._host_hit = 0
        self._received = 0
        self.preemptions = 0

    # -- requests -----------------------------------------------------------------------
    def add(self, req: EngineRequest) -> None:
        bs = self.bs
        extra: tuple[Any, ...] | None = (req.cache_salt,) if req.cache_salt is not None else None
        parent: int | None = None
        for i in range(len(req.prompt) // bs):
            # vLLM salts the first block only; its children inherit it through the chain.
            parent = block_hash(parent, req.prompt[i * bs:(i + 1) * bs], extra if i == 0 else None)
            req.hashes.append(parent)
        self.waiting.append(req)

    def abort(self, req: EngineRequest) -> None:
        """Drop a request (its client went away); its blocks are freed."""
        if req.finished:
            return
        req.finished = True
        if req in self.running:
            self.running.remove(req)
            self.pool.release(req.blocks)
        else:
            self.waiting.remove(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- a step -------------------------------------------------------------------------
    def schedule(self) -> Step:
        assert self.has_work
        if not self.waiting and self.running and all(r.num_computed == r.num_tokens - 1 for r in self.running):
            room = [len(r.blocks) * self.bs - r.num_computed for r in self.running]
            if min(room) > 0:
                steps = min(min(room), min(r.max_tokens - r.num_output for r in self.running))
                work = tuple((r, 1) for r in self.running)
                return Step(work, steps, 0, len(work), sum(r.num_computed for r in self.running))
        budget = self.cost.max_batch_tokens
        scheduled: dict[EngineRequest, int] = {}
        preempted = False
        decodes = [r for r in self.running if r.num_computed >= len(r.prompt)]
        prefills = [r for r in self.running if r.num_computed < len(r.prompt)]
        for req in decodes + prefills:
            if budget <= 0:
                break
            if req not in self.running:  # preempted by an earlier one of this loop
                continue
            n = min(req.num_tokens - req.num_computed, budget)
            while not self._grow(req, req.num_computed + n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                budget += scheduled.pop(victim, 0)
                if victim is req:
                    break
            else:
                scheduled[req] = n
                budget -= n
                self._cache_full(req, req.num_computed + n)
        work = list(scheduled.items())
        onboard_ms = 0.0
        while self.waiting and budget > 0 and len(self.running) < self.cost.batch_limit and not preempted:
            req = self.waiting[0]
            first = req.cached_tokens is None
            most = (req.num_tokens - 1) // self.bs
            hits = self.pool.match(req.hashes[:most])
            # The continuation on the host tier is loaded, not computed (no budget).
            loaded = self.host.match(req.hashes[len(hits):most]) if self.host is not None else 0
            hit_tokens = len(hits) * self.bs
            done = hit_tokens + loaded * self.bs
            # vLLM's NixlConnector receives every prompt token the caches lack, then
            # computes the last one again (its logits make the first output token).
            received = len(req.prompt) - done if req.receive_kv else 0
            if received:
                done = len(req.prompt) - 1
            n = min(req.num_tokens - done, budget)
            new = math.ceil((done + n) / self.bs) - len(hits)
            if not self.pool.can_take(hits, new):
                break
            self.waiting.popleft()
            self.pool.touch(hits)
            if loaded:
                assert self.host is not None
                self.host.touch(req.hashes[len(hits):len(hits) + loaded])
                onboard_ms += loaded * self.bs * self.cost.onboard_host_ms_per_token
            onboard_ms += received * self.cost.kv_transfer_ms_per_token
            req.receive_kv = False
            req.blocks = hits + (self.pool.allocate(new) or [])
            req.num_cached_blocks = len(hits)
            req.num_computed = done
            if first:
                req.cached_tokens = done
                self._queried += req.num_tokens
                self._hit += hit_tokens
                self._host_hit += loaded * self.bs
                self._received += received
            self.running.append(req)
            work.append((req, n))
            budget -= n
            # Cached now, as vLLM's allocate_slots caches: a request admitted later in the
            # same step already finds these blocks (their KV is written, layer by layer,
            # before any attention of the step reads it).
            self._cache_full(req, req.num_computed + n)
        prefill = sum(n for r, n in work if r.num_computed < len(r.prompt))
        dec = [r for r, n in work if r.num_computed >= len(r.prompt)]
        return Step(tuple(work), 1, prefill, len(dec), sum(r.num_computed for r in dec), onboard_ms)

    def complete(self, step: Step, steps: int | None = None) -> StepOutput:
        """The step's end (or, for a multi-step decode, the end of its first ``steps``):
        computed tokens advance, requests whose known tokens are all computed sample one
        token per step, and finished ones free their blocks."""
        k = step.steps if steps is None else steps
        advanced: list[tuple[EngineRequest, int]] = []
        finished: list[EngineRequest] = []
        for req, n in step.work:
            if req.finished:  # aborted during the step
                continue
            made = 0
            if step.steps > 1:
                req.num_computed += k
                req.num_output += k
                made = k
                self._cache_full(req, req.num_computed)
            else:
                req.num_computed += n
                if req.num_computed >= req.num_tokens:
                    req.num_output += 1
                    made = 1
            if made:
                advanced.append((req, made))
                if req.num_output >= req.max_tokens:
                    req.finished = True
                    self.running.remove(req)
                    self.pool.release(req.blocks)
                    finished.append(req)
        out = StepOutput(tuple(advanced), tuple(finished), self._queried, self._hit, self._host_hit,
                         self._received)
        self._queried = self._hit = self._host_hit = self._received = 0
        return out

    # -- blocks -------------------------------------------------------------------------
    def _grow(self, req: EngineRequest, tokens: int) -> bool:
        need = math.ceil(tokens / self.bs) - len(req.blocks)
        if need <= 0:
            return True
        got = self.pool.allocate(need)
        if got is None:
            return False
        req.blocks.extend(got)
        return True

    def _preempt(self, req: EngineRequest) -> None:
        self.running.remove(req)
        self.pool.release(req.blocks)
        req.blocks = []
        req.num_computed = 0
        req.num_cached_blocks = 0
        self.waiting.appendleft(req)
        self.preemptions += 1

    def _cache_full(self, req: EngineRequest, tokens: int) -> None:
        """Cache the blocks that ``tokens`` computed tokens fill (one BlockStored)."""
        full = min(tokens, req.num_tokens) // self.bs
        start = req.num_cached_blocks
        if full <= start:
            return
        bs = self.bs
        while len(req.hashes) < full:  # output blocks: hashed when they fill
            i = len(req.hashes)
            salt = (req.cache_salt,) if req.cache_salt is not None and i == 0 else None
            req.hashes.append(block_hash(req.hashes[-1] if i else None, req.token_slice(i * bs, (i + 1) * bs), salt))
        extra = None
        if req.cache_salt is not None and start == 0:
            extra = [(req.cache_salt,)] + [None] * (full - 1)
        self.pool.cache(req.blocks[start:full], req.hashes[start:full], req.hashes[start - 1] if start else None,
                        req.token_slice(start * bs, full * bs), extra)
        if self.host is not None:
            self.host.store(req.hashes[start:full])  # offloaded as soon as computed
        req.num_cached_blocks = full
