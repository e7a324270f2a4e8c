"""What the fold accepts from the events topic: the log's authority, made explicit
(docs/RELIABILITY.md, "Threat model").

Every check here depends only on the record itself (its key, timestamp and decoded
batch) or on the fold's state, never on a wall clock or on how partitions interleave,
so every replica and ``kvstream replay`` accept and reject exactly the same records.
A rejected batch or event is counted under its reason and copied to the DLQ.

The default :class:`LogAuthority` trusts everything (the fold of synthetic logs in
tests and tools); replicas and replay build theirs from the ``[fold]`` settings with
:func:`authority_from_settings`.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstream.events.wire import worker_key
from kvstream.settings import FoldSettings

# Counter reasons (batches rejected whole).
KEY_MISMATCH = "batch_key_mismatch"
NOT_ALLOWED = "worker_not_allowed"
EPOCH_AHEAD = "batch_epoch_ahead"
LEASE_TOO_LONG = "batch_lease_too_long"
TOO_MANY_WORKERS = "partition_worker_limit"
# Counter reasons (single events rejected).
EVENT_TOO_LARGE = "event_block_limit"
WORKER_FULL = "worker_block_limit"
PARTITION_FULL = "partition_block_limit"

# The default per-worker block limit, from a real engine's capacity: Llama-3.1-70B keeps
# 80 layers x 8 KV heads x 128 dims x (K, V) x 2 bytes = 320 KiB of KV cache a token in
# BF16, 5 MiB a block of 16 tokens. On an 8 x H200 node (141 GB each) at 90% memory
# use, after the 141 GB of weights, ~874 GB hold ~167,000 blocks (~334,000 with an FP8
# KV cache); a 2 TiB host tier adds ~419,000. 2^20 holds both with room for an FP8
# device tier or ~2.4 TB of disk tier; a larger cache needs max_blocks_per_worker raised.
DEFAULT_BLOCKS_PER_WORKER = 1 << 20

_NS_PER_MS = 1_000_000


@dataclass(frozen=True, slots=True)
class Rejection:
    reason: str
    detail: str

    def __str__(self) -> str:
        return f"{self.reason}: {self.detail}"


@dataclass(frozen=True, slots=True)
class LogAuthority:
    """Bounds on what one record may do; ``None`` (or False) turns a check off."""

    #: A batch's record key must be its worker id (:func:`worker_key`).
    check_key: bool = False
    #: Epochs that are wall-clock nanoseconds (the publisher's) may be at most this far
    #: ahead of their record's timestamp (ms): an epoch of 2**64-1 cannot lock a worker
    #: out. Counter epochs (1, 2, ...) are far below any timestamp and always pass.
    max_epoch_ahead_ms: int | None = None
    #: Longest lease a batch may ask for (ms): a lease bounds how long a silent worker
    #: (or a phantom) is kept.
    max_lease_ms: int | None = None
    #: Most blocks in one stored or removed event.
    max_blocks_per_event: int | None = None
    #: Most blocks one worker may hold over all ranks and tiers.
    max_blocks_per_worker: int | None = None
    #: Most blocks the workers bound to one partition may hold together: the fleet-wide
    #: budget (times the partition count), per partition so that it depends on one
    #: partition's records alone.
    max_blocks_per_partition: int | None = None
    #: Most workers bound to one partition at once.
    max_workers_per_partition: int | None = None
    #: Only these worker ids are accepted (None: any).
    allowed_workers: frozenset[int] | None = None

    def check_head(self, key: bytes | None, timestamp_ms: int, wid: int, epoch: int, lease_ms: int) -> Rejection | None:
        """Checks of a batch that need nothing but the record: its key, timestamp and
        head (worker id, epoch, lease)."""
        if self.check_key and key != worker_key(wid):
            got = "no key" if key is None else f"key {key.hex()}"
            return Rejection(KEY_MISMATCH, f"worker {wid} in a record with {got} (expected {worker_key(wid).hex()})")
        if self.allowed_workers is not None and wid not in self.allowed_workers:
            return Rejection(NOT_ALLOWED, f"worker {wid} is not on the allow-list")
        if self.max_epoch_ahead_ms is not None and epoch // _NS_PER_MS > timestamp_ms + self.max_epoch_ahead_ms:
            return Rejection(
                EPOCH_AHEAD,
                f"epoch {epoch} (as ns: {epoch // _NS_PER_MS} ms) is more than "
                f"{self.max_epoch_ahead_ms} ms ahead of the record's time {timestamp_ms} ms",
            )
        if self.max_lease_ms is not None and lease_ms > self.max_lease_ms:
            return Rejection(LEASE_TOO_LONG, f"lease {lease_ms} ms > {self.max_lease_ms} ms")
        return None

    def check_blocks(self, stored: bool, n: int, held: int) -> Rejection | None:
        """Size limits of a stored (or removed) event of ``n`` blocks, for a worker
        holding ``held`` blocks (an upper bound will do: the fold counts exactly before it
        rejects for the worker limit)."""
        if self.max_blocks_per_event is not None and n > self.max_blocks_per_event:
            return Rejection(EVENT_TOO_LARGE, f"{n} blocks > {self.max_blocks_per_event} per event")
        if self.max_blocks_per_worker is not None and stored and held + n > self.max_blocks_per_worker:
            return Rejection(
                WORKER_FULL, f"worker holds {held} blocks; {n} more exceed {self.max_blocks_per_worker}"
            )
        return None

    def partition_blocks_full(self, held: int, n: int) -> Rejection | None:
        """Whether a store of ``n`` blocks fits a partition whose workers hold ``held``
        (an upper bound will do: the fold counts exactly before it rejects)."""
        if self.max_blocks_per_partition is not None and held + n > self.max_blocks_per_partition:
            return Rejection(
                PARTITION_FULL,
                f"the partition's workers hold {held} blocks; {n} more exceed {self.max_blocks_per_partition}",
            )
        return None

    def partition_full(self, bound: int) -> Rejection | None:
        """Whether a partition that has ``bound`` workers may take one more."""
        if self.max_workers_per_partition is not None and bound >= self.max_workers_per_partition:
            return Rejection(TOO_MANY_WORKERS, f"partition already has {bound} workers (limit {self.max_workers_per_partition})")
        return None


#: Accepts whatever decodes (synthetic logs in tests and tools).
TRUSTING = LogAuthority()

REASONS: tuple[str, ...] = (
    KEY_MISMATCH, NOT_ALLOWED, EPOCH_AHEAD, LEASE_TOO_LONG, TOO_MANY_WORKERS, EVENT_TOO_LARGE, WORKER_FULL,
    PARTITION_FULL,
)


def authority_from_settings(settings: FoldSettings) -> LogAuthority:
    """The authority a replica (and replay, to agree with it) applies."""

    def opt(v: int) -> int | None:
        return v or None  # 0: no limit

    return LogAuthority(
        check_key=settings.check_key,
        max_epoch_ahead_ms=None if settings.max_epoch_ahead_ms < 0 else settings.max_epoch_ahead_ms,
        max_lease_ms=opt(settings.max_lease_ms),
        max_blocks_per_event=opt(settings.max_blocks_per_event),
        max_blocks_per_worker=opt(settings.max_blocks_per_worker),
        max_blocks_per_partition=opt(settings.max_blocks_per_partition),
        max_workers_per_partition=opt(settings.max_workers_per_partition),
        allowed_workers=None if settings.allowed_workers is None else frozenset(settings.allowed_workers),
    )
