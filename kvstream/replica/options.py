"""The options of a router replica, which define the ``[replica]`` section of the settings
(kvstream.settings derives it from these three dataclasses): where it serves and with
which credentials (:class:`ServerOptions`), the limits of its HTTP server
(:class:`HttpLimits`, kvstream.replica.http_limits), and how it folds, snapshots and
recovers (:class:`ReplicaOptions`)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

from pydantic import Field

from kvstream.options import internal

#: A bearer token: never empty, never shown (kvstream.replica.auth).
Token = Annotated[str, Field(min_length=1)]


@dataclass(frozen=True, slots=True)
class ServerOptions:
    """Where ``kvstream router`` serves its HTTP API, and who may call it."""

    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 8470
    #: Bearer token accepted for every scope of the HTTP API (unset: see the scoped ones;
    #: none at all: an open API, allowed on loopback only). kvstream.replica.auth.
    token: Token | None = field(default=None, repr=False)
    token_file: Path | None = None
    #: Tokens of one scope each: routing clients, operators (snapshot, workers), peers.
    #: ``peer_token`` is also what this replica presents to ``peer_url``.
    client_token: Token | None = field(default=None, repr=False)
    client_token_file: Path | None = None
    operator_token: Token | None = field(default=None, repr=False)
    operator_token_file: Path | None = None
    peer_token: Token | None = field(default=None, repr=False)
    peer_token_file: Path | None = None
    #: Bind a non-loopback address without any token (refused unless set).
    allow_open_bind: bool = False
    #: TLS for the HTTP API (PEM files; uvicorn's ssl_*).
    tls_certfile: Path | None = None
    tls_keyfile: Path | None = None
    #: Serve /docs and /openapi.json.
    http_docs: bool = False


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """The HTTP server's limits (kvstream.replica.http_limits)."""

    #: Request body cap (bytes, checked before parsing).
    max_body_bytes: Annotated[int, Field(ge=1024)] = 16 * 1024 * 1024
    #: Time to send the headers, and the body (s).
    header_timeout_s: Annotated[float, Field(gt=0)] = 10.0
    body_timeout_s: Annotated[float, Field(gt=0)] = 30.0
    #: Open connections.
    max_connections: Annotated[int, Field(ge=2)] = 1000
    #: Connections kept beyond max_connections for /healthz and /readyz alone.
    probe_connections: Annotated[int, Field(ge=0)] = 16
    #: Body bytes all requests in progress may hold together (429 past it).
    max_buffered_body_bytes: Annotated[int, Field(ge=1024)] = 64 * 1024 * 1024
    #: Routing decisions computed at once off the event loop.
    route_threads: Annotated[int, Field(ge=1)] = 4
    #: The largest route body decided on the event loop (bytes).
    inline_route_bytes: Annotated[int, Field(ge=0)] = 256 * 1024
    #: /v1/snapshot streams at once.
    snapshot_streams: Annotated[int, Field(ge=1)] = 2

    def __post_init__(self) -> None:
        if self.max_buffered_body_bytes < self.max_body_bytes:
            raise ValueError(
                f"max_buffered_body_bytes ({self.max_buffered_body_bytes}) must be at least "
                f"max_body_bytes ({self.max_body_bytes}): a body of the largest size could never be read"
            )


@dataclass(frozen=True, slots=True)
class ReplicaOptions:
    """How a replica folds, snapshots, recovers and shares load."""

    snapshot_dir: Path | None = None
    #: Take a snapshot after this many applied records, or this many seconds (0: never).
    snapshot_every_records: Annotated[int, Field(ge=0)] = 200_000
    snapshot_every_s: Annotated[float, Field(ge=0)] = 60.0
    #: Ready when every partition's lag (records) is at most this. Once ready, a replica
    #: that falls further behind (a burst: every replica at once) keeps routing, each
    #: decision marked stale, unless ``refuse_when_stale``: a slightly stale index routes
    #: far better than none.
    ready_max_lag: Annotated[int, Field(ge=0)] = 1000
    #: Once ready, refuse routing (503) while behind the log or cut off from the broker,
    #: instead of routing with each decision marked stale.
    refuse_when_stale: bool = False
    #: Records per consume() call.
    consume_batch: int = internal(2000)
    #: How often to look for partitions that need a log-clock tick (kvstream.replica.ticks).
    tick_interval_s: Annotated[float, Field(gt=0)] = 5.0
    #: A worker is asked to resync at most this often (s).
    resync_min_interval_s: float = internal(10.0)
    #: After a recovery that dropped workers (retention, recreated topic), stay unready
    #: until each has resynced (a newer epoch on the log), or at most this long (s).
    resync_wait_s: Annotated[float, Field(ge=0)] = 10.0
    #: Commit read positions to this replica's own consumer group this often (s), for
    #: Kafka's lag tooling (kvstream.replica.positions); 0: never.
    commit_interval_s: Annotated[float, Field(ge=0)] = 1.0
    #: Base URL of a peer replica to bootstrap from when there is no local snapshot.
    peer_url: str | None = None
    #: The bearer token presented to the peer (with its peer scope): the settings'
    #: ``peer_token``, else ``token`` (kvstream.replica.cli).
    peer_token: str | None = internal(None, repr=False)
    #: Largest peer snapshot accepted (bytes); CA bundle that verifies an https peer.
    peer_max_bytes: Annotated[int, Field(ge=1)] = 16 * 1024**3
    peer_ca_file: Path | None = None
    #: A record (value, key and headers) larger than this is referenced in the DLQ, not
    #: copied: far below the producer's message.max.bytes (1 MB by default).
    dlq_max_bytes: int = internal(256 * 1024)
    #: How often the routable workers' modes (events / approximate), the bounds of what
    #: they may be expected to hold and the predictions' expiry are refreshed (s).
    modes_interval_s: float = internal(1.0)
    #: How often the events topic's partition count is checked (s).
    metadata_interval_s: float = internal(10.0)
    #: A thread restarts after this (s), doubling up to ``thread_max_backoff_s``; a
    #: critical one that fails ``thread_max_failures`` times without progress is fatal.
    thread_backoff_s: float = internal(0.5)
    thread_max_backoff_s: float = internal(30.0)
    thread_max_failures: int = internal(5)
    #: Names the replica in logs, ticks and its consumer group ``kvstream-<replica_id>``,
    #: where it commits its read positions (for kafka-consumer-groups); keep it stable
    #: across restarts (e.g. the host name). Default: random per start.
    replica_id: Annotated[str, Field(min_length=1)] = field(
        default_factory=lambda: f"replica-{uuid.uuid4().hex[:12]}"
    )
