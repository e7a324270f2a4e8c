"""The options of ``kvstream worker`` that are settings: they define the ``[worker]``
section (kvstream.settings derives it from :class:`WorkerOptions`), and the publisher,
the engine node and the bridge take their defaults from here (:data:`DEFAULTS`)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Annotated

from pydantic import Field

from kvstream.roles import Handoff, Role


class Mode(str, Enum):
    """How the consolidator publishes (kvstream.worker.consolidator)."""

    DEDUP = "dedup"
    PASSTHROUGH = "passthrough"


class QueueFull(str, Enum):
    """What a full producer queue does to the caller."""

    BLOCK = "block"  # wait for room (up to block_timeout_s), then fail
    FAIL = "fail"  # fail at once


@dataclass(frozen=True, slots=True)
class WorkerOptions:
    """How ``kvstream worker`` consolidates and publishes (DESIGN.md §2, §3)."""

    #: ``dedup`` (one merged device residency) or ``passthrough`` (every tier).
    mode: Mode = Mode.DEDUP
    #: Routers keep a silent worker this long (log time); must outlast the heartbeat.
    lease_ms: Annotated[int, Field(ge=1)] = 10_000
    #: An empty batch goes out when nothing else did for this long (s).
    heartbeat_s: Annotated[float, Field(gt=0)] = 2.0
    #: How long events wait to share a Kafka message (ms).
    linger_ms: Annotated[float, Field(ge=0)] = 5.0
    #: A full producer queue blocks the worker (``block``) or fails it (``fail``).
    queue_full: QueueFull = QueueFull.BLOCK
    #: Prometheus port; 0: none.
    metrics_port: Annotated[int, Field(ge=0, le=65535)] = 0
    #: Engine bridge: where it keeps its state across restarts (None: it does not).
    state_dir: Path | None = None
    #: Engine bridge: checkpoint period (s), when the state changed.
    checkpoint_s: Annotated[float, Field(gt=0)] = 10.0
    #: Engine bridge: vLLM's offloading ``blocks_per_chunk`` (its placeholder events
    #: name a chunk by its last block; docs/ENGINES.md).
    offload_blocks_per_chunk: Annotated[int, Field(ge=1)] = 1
    #: What the engine does with a request (issue 34): ``both`` (all of it), or one leg of a
    #: disaggregated one, ``prefill`` or ``decode`` (vLLM's ``kv_role``, SGLang's
    #: ``--disaggregation-mode``). The rules of the three settings are
    #: kvstream.events.registration.check_role's.
    role: Role = Role.BOTH
    #: Prefill or decode only: how the KV goes from the prefill engine to the decode engine,
    #: ``nixl`` (vLLM's NixlConnector) or ``bootstrap`` (SGLang).
    handoff: Handoff | None = None
    #: A ``bootstrap`` prefill engine's ``--disaggregation-bootstrap-port``.
    bootstrap_port: int | None = None


#: The defaults, for the option dataclasses of the parts that take them.
DEFAULTS = WorkerOptions()
