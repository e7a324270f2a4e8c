"""The options of a router replica: the ``[replica]`` section of the settings."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from pathlib import Path

from kvstream.replica.fold import FOLD_SLICE


@dataclass(frozen=True, slots=True)
class ReplicaOptions:
    """How a replica runs (the ``[replica]`` section of the settings)."""

    snapshot_dir: Path | None = None
    #: Take a snapshot after this many applied records, or this many seconds (0: never).
    snapshot_every_records: int = 200_000
    snapshot_every_s: float = 60.0
    #: Ready when every partition's lag (records) is at most this. Once ready, a replica
    #: that falls further behind (a burst: every replica at once) keeps routing, each
    #: decision marked stale, unless ``refuse_when_stale``: a slightly stale index routes
    #: far better than none.
    ready_max_lag: int = 1000
    refuse_when_stale: bool = False
    #: Records per consume() call.
    consume_batch: int = 2000
    #: Records folded between looks at the clock under the router lock, which ingest
    #: holds for about kvstream.replica.fold.FOLD_HOLD_S at a time (FOLD_SLICE).
    fold_slice: int = FOLD_SLICE
    #: How often to look for partitions that need a log-clock tick (kvstream.replica.ticks).
    tick_interval_s: float = 5.0
    #: Rebuild load from this much of kvstream.active at start (s); the request TTL.
    active_window_s: float = 300.0
    #: A worker is asked to resync at most this often (s).
    resync_min_interval_s: float = 10.0
    #: After a recovery that dropped workers (retention, recreated topic), stay unready
    #: until each has resynced (a newer epoch on the log), or at most this long (s).
    resync_wait_s: float = 10.0
    #: Commit read positions to this replica's own consumer group this often (s), for
    #: Kafka's lag tooling (kvstream.replica.positions); 0: never.
    commit_interval_s: float = 1.0
    #: Base URL of a peer replica to bootstrap from when there is no local snapshot.
    peer_url: str | None = None
    #: Bearer token of the peer's HTTP API (with its peer scope).
    peer_token: str | None = None
    #: Largest peer snapshot accepted (bytes); CA bundle that verifies an https peer.
    peer_max_bytes: int = 16 * 1024**3
    peer_ca_file: Path | None = None
    #: A record (value, key and headers) larger than this is referenced in the DLQ, not
    #: copied: far below the producer's message.max.bytes (1 MB by default).
    dlq_max_bytes: int = 256 * 1024
    #: How often the events topic's partition count is checked (s).
    metadata_interval_s: float = 10.0
    #: A thread restarts after this (s), doubling up to ``thread_max_backoff_s``; a
    #: critical one that fails ``thread_max_failures`` times without progress is fatal.
    thread_backoff_s: float = 0.5
    thread_max_backoff_s: float = 30.0
    thread_max_failures: int = 5
    replica_id: str = field(default_factory=lambda: f"replica-{uuid.uuid4().hex[:12]}")
