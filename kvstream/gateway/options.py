"""How the gateway runs: the ``[gateway]`` section of the settings (kvstream.settings
validates it as these dataclasses, so that each option is defined here once), and the
static workers of ``[[gateway.workers]]``."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Literal

from pydantic import ConfigDict

from kvstream.gateway.errors import OptionsError
from kvstream.roles import Handoff, Role

_U64_END = 1 << 64


@dataclass(frozen=True, slots=True)
class StaticWorker:
    """One worker of ``[[gateway.workers]]``: the id its KV events carry, the engine's
    base URL (``http://host:port``, without ``/v1``), and what it serves."""

    __pydantic_config__ = ConfigDict(extra="forbid")

    id: int
    url: str
    models: tuple[str, ...]
    loras: tuple[str, ...] = ()
    #: The worker's own credential, sent as ``Authorization: Bearer`` (the client's never is).
    api_key: str | None = field(default=None, repr=False)
    #: Data-parallel ranks of the engine (candidates before any event names them).
    dp_ranks: int = 1
    #: Blocks the engine keeps cached per rank (its device tier, plus the host memory it
    #: offloads to): the most blocks it may be expected to hold (routed there, not
    #: confirmed by events; what routes an engine without events); unknown: [router]
    #: expected_blocks.
    kv_capacity_blocks: int | None = None
    #: ``both``, or one leg of a disaggregated request: ``prefill`` or ``decode`` (issue 34;
    #: a Role's value; kvstream.gateway.static checks the rules of the three settings).
    role: str = "both"
    #: Prefill or decode only: ``nixl`` (vLLM's NixlConnector) or ``bootstrap`` (SGLang).
    handoff: str | None = None
    #: A ``bootstrap`` prefill engine's ``--disaggregation-bootstrap-port``.
    bootstrap_port: int | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.id < _U64_END:
            raise OptionsError(f"worker id {self.id} is not in [0, 2**64)")
        if not self.url.startswith(("http://", "https://")) or self.url.rstrip("/").endswith("/v1"):
            raise OptionsError(f"worker {self.id}: url must be http(s)://host:port without /v1, got {self.url!r}")
        if not self.models or not all(self.models) or not all(self.loras):
            raise OptionsError(f"worker {self.id}: models must name at least one model, and no name may be empty")
        if self.dp_ranks < 1:
            raise OptionsError(f"worker {self.id}: dp_ranks must be >= 1, got {self.dp_ranks}")
        if self.kv_capacity_blocks is not None and self.kv_capacity_blocks < 0:
            raise OptionsError(f"worker {self.id}: kv_capacity_blocks must be >= 0, got {self.kv_capacity_blocks}")
        if self.api_key is not None and not self.api_key.strip():
            raise OptionsError(f"worker {self.id}: api_key is empty")
        if self.role not in tuple(Role):
            raise OptionsError(f"worker {self.id}: role must be one of {', '.join(Role)}, got {self.role!r}")
        if self.handoff is not None and self.handoff not in tuple(Handoff):
            raise OptionsError(f"worker {self.id}: handoff must be one of {', '.join(Handoff)}, got {self.handoff!r}")


#: Bytes of token ids and text a model's prefix cache holds by default.
DEFAULT_CACHE_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class ModelTokenizerConfig:
    """One ``[[gateway.models]]`` entry: a model's tokenizer (kvstream.gateway.tokenize)."""

    __pydantic_config__ = ConfigDict(extra="forbid")

    #: The model name requests give (``model``).
    name: str
    #: A directory holding ``tokenizer.json`` (and ``tokenizer_config.json``), or a
    #: ``tokenizer.json`` file (then no chat template unless ``chat_template`` is set).
    tokenizer: Path
    #: A jinja chat template file, instead of the one in ``tokenizer_config.json``.
    chat_template: Path | None = None
    #: Bytes of token ids and text the prefix cache may hold; 0: no cache.
    prefix_cache_bytes: int = DEFAULT_CACHE_BYTES

    def __post_init__(self) -> None:
        if not self.name:
            raise OptionsError("[[gateway.models]]: name must not be empty")
        if self.prefix_cache_bytes < 0:
            raise OptionsError(f"model {self.name}: prefix_cache_bytes must be >= 0, got {self.prefix_cache_bytes}")


@dataclass(frozen=True, slots=True)
class GatewayOptions:
    """The gateway of a router replica (the OpenAI endpoints; kvstream.gateway)."""

    __pydantic_config__ = ConfigDict(extra="forbid")

    #: Serve the OpenAI endpoints on the replica's HTTP port.
    enabled: bool = True
    #: Workers from the TOML, for fleets without registering bridges (registered
    #: workers, from kvstream.workers, are candidates too).
    workers: tuple[StaticWorker, ...] = ()
    #: ``[[gateway.models]]``: each model's local tokenizer, for text prompts.
    models: tuple[ModelTokenizerConfig, ...] = ()
    #: Where text prompts get their token ids: ``auto``, the model's local tokenizer when
    #: ``[[gateway.models]]`` gives one, else the ``/tokenize`` endpoint of one candidate
    #: engine (vLLM and SGLang serve it); ``local`` or ``engine`` only.
    tokenize: Literal["auto", "local", "engine"] = "auto"
    #: A completions request of one text prompt goes to the worker with the token ids the
    #: gateway routed it by in place of the text, so the engine does not tokenize it again
    #: (as Dynamo's frontend sends its workers ids): ids an engine's ``/tokenize`` gave,
    #: or a local tokenizer's once one engine's ``/tokenize`` gave the same ids for a
    #: prompt of the model (else the text goes, and the disagreement is logged). Not with
    #: ``echo`` (the answer repeats the prompt as sent) nor ``add_special_tokens: false``.
    send_token_ids: bool = True
    #: Further workers tried when one fails before its first byte (each a different one).
    retries: int = 2
    #: Seconds to connect to a worker; seconds without a byte from it (before the first
    #: byte: the request is retried elsewhere; after: the stream ends with an error).
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 300.0
    #: Requests relayed at once by this replica (more: 429), and per worker (0: no limit).
    max_inflight: int = 4096
    max_inflight_per_worker: int = 0
    #: A request over ``max_inflight`` waits this long for a slot (0: 429 at once),
    #: with at most ``max_queued`` waiting.
    queue_timeout_s: float = 0.0
    max_queued: int = 1024
    #: A request that comes while the replica is not ready (starting from its snapshot,
    #: catching up with the log) waits this long for it before a 503 (0: at once): a
    #: restarted replica's first second is then a little latency, not failed requests.
    ready_wait_s: float = 5.0
    #: The ``Retry-After`` of a 429 or 503 (s).
    retry_after_s: int = 1
    #: A worker's breaker opens after this many failures in a row, and lets one trial
    #: request through after the cool-down (s).
    breaker_failures: int = 3
    breaker_cooldown_s: float = 10.0
    #: The engines' ``/health`` is asked this often (s; 0: never), with this timeout.
    health_interval_s: float = 5.0
    health_timeout_s: float = 2.0
    #: Longest prompt accepted (tokens; the default is what ``POST /v1/route`` takes).
    max_prompt_tokens: int = 1 << 20
    #: Requests whose body is larger than this (bytes) are tokenized off the event loop.
    inline_tokenize_bytes: int = 16_384
    #: Connections kept open to the workers (0: no limit).
    upstream_connections: int = 1024

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name.endswith("_s") and not (math.isfinite(value) and value >= 0):
                raise OptionsError(f"{f.name} must be a finite number >= 0, got {value!r}")
            if type(value) is int and value < 0:
                raise OptionsError(f"{f.name} must be >= 0, got {value!r}")
        for name in ("max_inflight", "breaker_failures", "max_prompt_tokens"):
            if getattr(self, name) < 1:
                raise OptionsError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("connect_timeout_s", "read_timeout_s", "health_timeout_s"):
            if getattr(self, name) <= 0:
                raise OptionsError(f"{name} must be > 0, got {getattr(self, name)}")
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            raise OptionsError(f"[[gateway.models]] names a model twice: {sorted(names)}")
        ids = [w.id for w in self.workers]
        if len(set(ids)) != len(ids):
            raise OptionsError(f"[[gateway.workers]] names a worker id twice: {sorted(ids)}")
