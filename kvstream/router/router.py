"""The in-process router (DESIGN.md §4–§6, §9): tier indexes, active sequences, learned
prefill rates and the decision behind one object that owns them (callers use its
methods, never its fields). It knows nothing of Kafka: the replica's fold feeds it router
events with their hashes still packed in the record (``apply_packed``), and peers'
active-sequence ops (``apply_active``); ``apply_event`` applies a model event (the
benchmarks' baselines, the reference models in tests)."""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from kvstream.events.model import RouterEvent, Tier
from kvstream.hashing import DEFAULT_BLOCK_SIZE, MmSpan, identity_seed, local_hashes
from kvstream.router.active import (
    DEFAULT_TTL_S,
    ActiveOp,
    ActiveSequences,
    AddRequest,
    FreeRequest,
    PackedHashes,
    PrefillDone,
    WorkerLoad,
)
from kvstream._native import WorkerTables
from kvstream.router.core import Prompt, PromptTokens, decide
from kvstream.router.errors import NoEligibleWorkerError, UnknownWorkerError
from kvstream.router.index import (
    DEFAULT_EXPECTED_BLOCKS,
    DEFAULT_EXPECTED_TTL_S,
    TieredIndex,
    TierOverlap,
    WorkerBlocks,
    WorkerKey,
)
from kvstream.router.scheduler import CandidateScore, Schedule, SchedulerConfig, SchedulerOverrides


@dataclass(frozen=True, slots=True)
class RouterConfig:
    block_size: int = DEFAULT_BLOCK_SIZE
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    #: Active requests older than this are expired (§6).
    request_ttl_s: float = DEFAULT_TTL_S
    #: A routed prompt's blocks are expected on its worker until the engine's events
    #: confirm them, its request fails, or this long (s) has passed since it was routed
    #: (issue 33; an engine without events is routed by them alone).
    expected_ttl_s: float = DEFAULT_EXPECTED_TTL_S
    #: Most blocks expected per worker rank whose registration gives no device capacity.
    expected_blocks: int = DEFAULT_EXPECTED_BLOCKS

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if not (self.expected_ttl_s > 0 and math.isfinite(self.expected_ttl_s)):
            raise ValueError(f"expected_ttl_s must be a finite number > 0, got {self.expected_ttl_s}")
        if self.expected_blocks < 0:
            raise ValueError(f"expected_blocks must be >= 0, got {self.expected_blocks}")


@dataclass(frozen=True, slots=True)
class RouteDecision:
    """The chosen candidate and everything needed to explain the choice."""

    worker: WorkerKey
    request_id: str | None
    #: Prompt length in tokens, and its full blocks.
    isl: int
    blocks: int
    #: Every known candidate: inputs (per-tier overlaps, load), logit terms, chances.
    schedule: Schedule
    #: The active-sequence op this decision applied (None for query-only or anonymous
    #: requests), for sharing with peer replicas.
    op: AddRequest | None

    @property
    def candidates(self) -> tuple[CandidateScore, ...]:
        return self.schedule.scores()

    @property
    def chosen(self) -> CandidateScore:
        return self.schedule.score(self.schedule.chosen)

    @property
    def overlaps(self) -> dict[WorkerKey, TierOverlap]:
        cands = self.schedule.candidates
        return {w: TierOverlap(*o) for w, o in zip(cands.workers, cands.overlaps.tolist())}

    @property
    def logits(self) -> dict[WorkerKey, float]:
        return dict(zip(self.schedule.candidates.workers, self.schedule.columns.logit.tolist()))


@dataclass(frozen=True, slots=True)
class LearnedRates:
    """The ttft policy's learned prefill throughput (kvstream.router.rates.PrefillRates)."""

    #: Per worker rank with samples: tokens/s (None while its sums carry no time).
    per_worker: dict[WorkerKey, float | None]
    #: The fleet's pooled tokens/s (None: no sample yet).
    fleet: float | None
    #: Seconds per prefilled token per active decode block.
    decode_slowdown_s: float
    #: The model's relative error at the configured rate scope (PrefillRates.error).
    error: float


#: Departed workers a router remembers (the latest ones).
DEPARTED_KEPT = 8


class Router:
    """KV-aware router over the workers that published events to it."""

    def __init__(
        self,
        config: RouterConfig | None = None,
        *,
        clock: Callable[[], float] = time.time,
        rng: random.Random | None = None,
    ) -> None:
        self.config = config or RouterConfig()
        self._clock = clock
        self._index = TieredIndex(self.config.expected_ttl_s, self.config.expected_blocks)
        #: The index's apply of an event still packed in a message (the fold's one path:
        #: bound here, not wrapped, so that it costs no extra call per event).
        self.apply_packed: Callable[..., str | None] = self._index.apply_packed
        self._active = ActiveSequences(self.config.request_ttl_s, clock)
        #: The uniform draws of decisions (tie-breaks, sampling): seedable.
        self._rng = rng or random.Random()
        #: This router's part of a tie, of the routers deciding at once (split_ties).
        self._split = (0, 1)
        #: Why the last workers that were removed left (worker id → what happened), so
        #: that a router with none left says what became of them.
        self._departed: dict[int, str] = {}

    # -- state from the log ----------------------------------------------------------

    def apply_event(self, event: RouterEvent) -> str | None:
        """Apply a router event; returns the counter reason if it was rejected."""
        return self._index.apply(event)

    def apply_active(self, op: ActiveOp) -> None:
        """Apply an active-sequence op (e.g. from a peer replica): an add also makes its
        prompt's blocks expected on its worker, a refuted free takes them back."""
        refuted = self._active.apply(op)
        if type(op) is AddRequest:
            seqs = op.sequence_hashes
            self._index.expect(
                WorkerKey(op.worker_id, op.dp_rank), seqs.data if type(seqs) is PackedHashes else seqs, op.timestamp
            )
        elif refuted is not None:
            self._index.unexpect(refuted.worker, refuted.sequence_hashes)

    def workers(self) -> list[WorkerKey]:
        return self._index.workers()

    def is_active(self, request_id: str) -> bool:
        return request_id in self._active

    def active_requests(self) -> int:
        return len(self._active)

    # -- the index, read and written through the router (callers never hold it) -------

    def knows(self, worker_id: int) -> bool:
        """Whether the index knows any rank of the worker."""
        return self._index.knows(worker_id)

    def keys_of(self, worker_id: int) -> list[WorkerKey]:
        """Every rank the index knows of a worker (none when it knows none)."""
        return self._index.keys_of(worker_id)

    def worker_blocks(self, worker_id: int) -> int:
        """Blocks a worker holds over every rank and tier."""
        return self._index.worker_blocks(worker_id)

    def tree_sizes(self) -> dict[WorkerKey, dict[Tier, int]]:
        """Blocks held per known worker rank per tier."""
        return self._index.tree_sizes()

    def blocks(self, key: WorkerKey, tier: Tier) -> Mapping[int, int]:
        """A worker rank's blocks on a tier: block hash → sequence hash (read-only)."""
        return self._index.blocks(key, tier)

    def index_heap_bytes(self) -> int:
        """Bytes the index's tables take (TieredIndex.heap_bytes): a replica's memory per
        block, without the process around it."""
        return self._index.heap_bytes()

    def find_matches_by_tier(
        self, local_hashes: Sequence[int], seq_hashes: Sequence[int] | None = None
    ) -> dict[WorkerKey, TierOverlap]:
        """Per worker rank with any match, the prompt's leading blocks on each tier and
        expected (TieredIndex.find_matches_by_tier), as of the clock."""
        self._index.expire_expected(self._clock())
        return self._index.find_matches_by_tier(local_hashes, seq_hashes)

    def expected_blocks(self) -> dict[WorkerKey, int]:
        """Blocks expected per worker rank (routed there, not confirmed), as of the clock."""
        self._index.expire_expected(self._clock())
        return self._index.expected_counts()

    def expected_total(self) -> int:
        """Blocks expected over every worker rank (expired ones may linger until the
        next decision or :meth:`expire_expected`)."""
        return self._index.expected_total()

    def set_expected_capacity(self, worker_id: int, ranks: Iterable[int], blocks: int | None) -> None:
        """The device capacity of each rank of a worker in blocks (None: unknown): what
        it may be expected to hold at most."""
        for rank in ranks:
            self._index.set_expected_capacity(WorkerKey(worker_id, rank), blocks)

    def expire_expected(self, now: float | None = None) -> None:
        """Drop the expected blocks older than their TTL at ``now`` (default: the clock),
        and the slots of candidates left with none (the replica does it periodically)."""
        self._index.expire_expected(self._clock() if now is None else now)
        self._index.release_idle()

    def forget_expected(self, worker_id: int) -> None:
        """Drop what a worker the index does not know by its events is expected to hold
        (it left the fleet)."""
        self._index.forget(worker_id)

    def rejections(self) -> dict[str, int]:
        """The index's counters of rejected or skipped events (kvstream.router.index.REASONS)."""
        return dict(self._index.counters)

    def clear_worker(self, worker_id: int) -> None:
        """Drop every block of a worker (a new incarnation); it stays known."""
        self._index.clear_worker(worker_id)

    def unindex(self, worker_id: int) -> list[WorkerKey]:
        """Forget a worker's ranks and blocks, not its load (a batch that only named it,
        a snapshot's older incarnation); remove_worker is the departure of a worker."""
        return self._index.remove_worker(worker_id)

    def export_worker(self, worker_id: int) -> list[WorkerBlocks]:
        """Every block of a worker, per rank and tier (for snapshots and diffs)."""
        return self._index.export_worker(worker_id)

    def export_tables(self, worker_id: int) -> bytes:
        """A worker's index tables as a snapshot blob holds them."""
        return self._index.export_tables(worker_id)

    def import_worker(self, worker_id: int, parts: WorkerTables | Iterable[WorkerBlocks]) -> None:
        """Install an exported worker (it must be unknown)."""
        self._index.import_worker(worker_id, parts)

    def import_workers(self, workers: Mapping[int, WorkerTables]) -> None:
        """Install unknown workers' snapshot tables in one step (a restore)."""
        self._index.import_workers(workers)

    def load(self, key: WorkerKey) -> WorkerLoad | None:
        """A worker rank's load from routed requests (None: no active request)."""
        return self._active.load(key)

    def loads_for(self, keys: Sequence[WorkerKey], seq_hashes: Sequence[int]) -> list[tuple[bool, int, int, int, int]]:
        """Per key: (has load, prefill tokens, decode blocks, requests, new blocks of
        ``seq_hashes``): what a decision reads of the load."""
        return self._active.loads_for(keys, seq_hashes)

    def learned_rates(self) -> LearnedRates:
        """What the ttft policy has learned from observed times to first token."""
        rates = self._active.rates
        return LearnedRates(
            {k: rates.rate(k) for k in rates.keys()}, rates.fleet_rate(), rates.decode_slowdown(),
            rates.error(self.config.scheduler.ttft_rate_scope),
        )

    def split_ties(self, part: int, parts: int) -> None:
        """Break ties among the candidates in this router's part: the candidates in key
        order cut into ``parts`` runs, run ``part`` preferred (every tie when none of
        it is tied). Replicas that route at once (``parts`` of them, this one ``part``)
        thus send simultaneous requests to different idle workers, where each would pick
        the same one before the others' load ops reach it. ``(0, 1)``: uniform."""
        if not 0 <= part < parts:
            raise ValueError(f"split part {part} of {parts}: needs 0 <= part < parts")
        self._split = (part, parts)

    def reseed(self, seed: int) -> None:
        """Restart the stream of uniform draws (tie-breaks, sampling) from ``seed``."""
        self._rng.seed(seed)

    def remove_worker(self, worker_id: int, why: str | None = None, demote_at: float | None = None) -> list[WorkerKey]:
        """Forget a worker: its blocks on every tier and rank, and its active requests.
        ``why`` (e.g. "expired at …") is what a route says of it once no worker is left;
        ``demote_at``: its events stopped at that time, and what it held on the device
        is expected there from then (TieredIndex.remove_worker)."""
        if not self._index.knows(worker_id):
            raise UnknownWorkerError(f"worker {worker_id} is not known to the router")
        self.drop_requests(worker_id)
        if why is not None:
            self._departed.pop(worker_id, None)
            self._departed[worker_id] = why
            while len(self._departed) > DEPARTED_KEPT:
                del self._departed[next(iter(self._departed))]
        return self._index.remove_worker(worker_id, demote_at)

    def no_workers(self) -> NoEligibleWorkerError:
        """The error of a route with no worker known, saying what became of the last ones."""
        gone = [f"worker {wid} {why}" for wid, why in self._departed.items() if not self._index.knows(wid)]
        if not gone:
            return NoEligibleWorkerError("no workers known: none has published an event within its lease")
        return NoEligibleWorkerError("no workers known: " + "; ".join(reversed(gone)))

    def drop_requests(self, worker_id: int) -> list[str]:
        """Forget a removed worker's active requests (its load went with it); returns
        their ids. Replay applies it where the worker was removed among the ops."""
        return self._active.remove_worker(worker_id)

    # -- requests --------------------------------------------------------------------

    def find_best_match(
        self,
        token_ids: PromptTokens,
        lora_name: str | None = None,
        request_id: str | None = None,
        query_only: bool = False,
        overrides: SchedulerOverrides | None = None,
        *,
        cache_salt: str | None = None,
        mm: Sequence[MmSpan] = (),
        candidates: Sequence[WorkerKey] | None = None,
    ) -> RouteDecision:
        """Choose a worker for a prompt. With a ``request_id`` and not ``query_only``,
        the request is added to the active sequences (``decision.op``). The policy is
        the config's, or ``overrides.policy``. ``cache_salt`` and ``mm`` (multimodal
        spans) change the blocks' identity as in DESIGN §1. ``candidates``: only these
        keys and the other ranks the index knows of their workers compete, indexed or
        not (a registered worker that has published nothing yet competes with no
        overlap); None: every worker the index knows."""
        if candidates is None and not self._index.workers():
            raise self.no_workers()
        # A salt changes only the seed; multimodal spans change some blocks' bytes, so
        # their local hashes are computed here (kvstream.hashing, the one definition)
        # and the core chains them.
        local = local_hashes(token_ids, self.config.block_size, lora_name, cache_salt=cache_salt, mm=mm) if mm else None
        prompt = Prompt(token_ids, identity_seed(lora_name, cache_salt), local)
        tracked_id = request_id if request_id is not None and not query_only else None
        return self._decide(prompt, request_id, tracked_id, overrides, candidates)

    def _decide(
        self,
        prompt: Prompt,
        request_id: str | None,
        tracked_id: str | None,
        overrides: SchedulerOverrides | None,
        candidates: Sequence[WorkerKey] | None,
        now: float | None = None,
        max_tokens: int | None = None,
        blocks: int | None = None,
    ) -> RouteDecision:
        now = self._clock() if now is None else now
        # The core adds the request when it gets an id; a query-only decision still
        # names the id it was asked with.
        schedule, seqs, isl = decide(
            self._index, self._active, self._rng, self.config.scheduler.with_overrides(overrides),
            self.config.block_size, prompt, tracked_id, now, candidates, max_tokens, self._split,
        )
        winner = schedule.candidates.workers[schedule.chosen]
        op = None
        if tracked_id is not None and seqs is not None:
            cached = int(schedule.columns.cached_tokens[schedule.chosen])
            op = AddRequest(tracked_id, winner.worker_id, winner.dp_rank, isl, cached, seqs, now)
        blocks = isl // self.config.block_size if blocks is None else blocks
        return RouteDecision(winner, request_id, isl, blocks, schedule, op)

    def decide_logged(
        self,
        isl: int,
        seq_hashes: Sequence[int],
        request_id: str | None,
        now: float,
        overrides: SchedulerOverrides | None = None,
        *,
        candidates: Sequence[WorkerKey] | None = None,
    ) -> RouteDecision:
        """The query-only decision for a prompt given by its length and its blocks'
        sequence hashes (replay tools: the log keeps no token ids), at ``now``;
        ``candidates`` as in find_best_match. Expires old requests first; applies
        nothing else."""
        seqs = seq_hashes.data if isinstance(seq_hashes, PackedHashes) else list(seq_hashes)
        prompt = Prompt(isl=isl, sequence_hashes=seqs)
        return self._decide(prompt, request_id, None, overrides, candidates, now, blocks=len(seq_hashes))

    def prefill_done(self, request_id: str) -> PrefillDone:
        """The request's first token came out; returns the op applied (to share)."""
        op = PrefillDone(request_id, self._clock())
        self._active.apply(op)
        return op

    def free(self, request_id: str, refuted: bool = False) -> FreeRequest:
        """The request finished or was cancelled (``refuted``: before its prompt was
        computed, so its blocks are no longer expected on its worker); returns the op
        applied (to share)."""
        op = FreeRequest(request_id, self._clock(), refuted)
        self.apply_active(op)
        return op

