"""One typed settings object for every command: flags > ``KVSTREAM_*`` env > TOML > defaults.

Nested sections are set from the environment with a double underscore, e.g.
``KVSTREAM_ROUTER__HOST_CACHE_HIT_WEIGHT=0.5``; the TOML file uses ``[router]``.
The file is named by ``--config`` or ``KVSTREAM_CONFIG``. An unknown key at any level is
an error that names the nearest valid one (a typo must never pass silently); an unknown
``KVSTREAM_*`` variable is warned about. ``kvstream config show`` prints the effective
settings and where each came from.
"""

from __future__ import annotations

import difflib
import os
import tomllib
import uuid
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, model_validator
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from kvstream.gateway.options import GatewayOptions
from kvstream.hashing import DEFAULT_BLOCK_SIZE
from kvstream.router.active import DEFAULT_TTL_S
from kvstream.router.scheduler import config_fields

_config_file: Path | None = None
_warned = False  # unknown KVSTREAM_* variables are reported once per process


class SettingsError(ValueError):
    """Settings that cannot be loaded; the message says which and why."""


class Section(BaseModel):
    """A section of the settings: an unknown key in it is an error, not ignored."""

    model_config = ConfigDict(extra="forbid")


class TopicSettings(Section):
    """Names and settings of the topics of DESIGN.md §2."""

    prefix: str = "kvstream."
    events_partitions: int = Field(12, ge=1)
    events_retention_ms: int = Field(24 * 3600 * 1000, ge=60_000)
    active_partitions: int = Field(1, ge=1)
    active_retention_ms: int = Field(3600 * 1000, ge=60_000)
    control_partitions: int = Field(1, ge=1)
    control_retention_ms: int = Field(3600 * 1000, ge=60_000)
    dlq_partitions: int = Field(1, ge=1)
    dlq_retention_ms: int = Field(7 * 24 * 3600 * 1000, ge=60_000)
    #: The compacted worker registry (kvstream.gateway.registry): a handful of records.
    workers_partitions: int = Field(1, ge=1)
    #: How long a worker's tombstone stays readable after compaction (delete.retention.ms):
    #: a replica down for longer may keep a departed worker until it restarts from the start.
    workers_tombstone_retention_ms: int = Field(7 * 24 * 3600 * 1000, ge=60_000)
    #: The broker refuses events stamped further than this ahead of its clock (ms; 0: no
    #: bound): a record from the future would move its partition's log clock and expire
    #: every worker there. Keep it below the workers' lease minus their heartbeat.
    events_max_future_ms: int = Field(5000, ge=0)
    #: Replication factor; 0 means min(3, number of brokers).
    replication_factor: int = Field(0, ge=0)

    def name(self, topic: str) -> str:
        return f"{self.prefix}{topic}"


def _scheduler_settings() -> dict[str, Any]:
    """The ``[router]`` fields of the scheduler: SchedulerConfig's (their one definition:
    types, defaults, bounds and choices)."""
    out: dict[str, Any] = {}
    for f, hint in config_fields(setting=True):
        choices = f.metadata["choices"]
        if choices is not None:
            out[f.name] = (Literal[choices], f.default)  # type: ignore[valid-type]
        elif f.metadata["positive"]:
            out[f.name] = (hint, Field(f.default, gt=0))
        else:
            out[f.name] = (hint, Field(f.default, ge=0))
    return out


class _RouterSection(Section):
    """Block size, the active requests' TTL, admission, and the scheduler's global
    weights (DESIGN.md §5; ref defaults), whose fields come from SchedulerConfig."""

    block_size: int = Field(DEFAULT_BLOCK_SIZE, ge=1)
    request_ttl_s: float = Field(DEFAULT_TTL_S, gt=0)
    #: Only workers with a live registration on kvstream.workers (or listed in
    #: ``[[gateway.workers]]``) may win a ``POST /v1/route``: a worker id that only ever
    #: published events is a phantom (kvstream.replica.admission). Turn it off only for a
    #: fleet whose bridges do not register; every replica and ``kvstream replay`` of a
    #: deployment must agree on it.
    require_registration: bool = True


RouterSettings = create_model("RouterSettings", __base__=_RouterSection, **_scheduler_settings())


class ReplicaSettings(Section):
    """How ``kvstream router`` runs a replica (DESIGN.md §7, §9)."""

    host: str = "127.0.0.1"
    port: int = Field(8470, ge=0, le=65535)
    #: Bearer token accepted for every scope of the HTTP API (unset: see the scoped ones;
    #: none at all: an open API, allowed on loopback only). kvstream.replica.auth.
    token: str | None = Field(None, min_length=1)
    token_file: Path | None = None
    #: Tokens of one scope each: routing clients, operators (snapshot, workers), peers.
    #: ``peer_token`` is also what this replica presents to ``peer_url``.
    client_token: str | None = Field(None, min_length=1)
    client_token_file: Path | None = None
    operator_token: str | None = Field(None, min_length=1)
    operator_token_file: Path | None = None
    peer_token: str | None = Field(None, min_length=1)
    peer_token_file: Path | None = None
    #: Bind a non-loopback address without any token (refused unless set).
    allow_open_bind: bool = False
    #: TLS for the HTTP API (PEM files; uvicorn's ssl_*); a CA bundle to verify an https peer.
    tls_certfile: Path | None = None
    tls_keyfile: Path | None = None
    peer_ca_file: Path | None = None
    #: Largest peer snapshot accepted at bootstrap (bytes).
    peer_max_bytes: int = Field(16 * 1024**3, ge=1)
    #: Serve /docs and /openapi.json.
    http_docs: bool = False
    #: HTTP limits (kvstream.replica.http_limits): request body cap (bytes, checked
    #: before parsing), time to send the headers and the body, open connections,
    #: routing decisions computed at once off the event loop, the largest route body
    #: decided on the event loop (bytes), /v1/snapshot streams.
    max_body_bytes: int = Field(16 * 1024 * 1024, ge=1024)
    header_timeout_s: float = Field(10.0, gt=0)
    body_timeout_s: float = Field(30.0, gt=0)
    max_connections: int = Field(1000, ge=2)
    #: Connections kept beyond max_connections for /healthz and /readyz alone.
    probe_connections: int = Field(16, ge=0)
    #: Body bytes all requests in progress may hold together (429 past it).
    max_buffered_body_bytes: int = Field(64 * 1024 * 1024, ge=1024)
    route_threads: int = Field(4, ge=1)
    inline_route_bytes: int = Field(256 * 1024, ge=0)
    snapshot_streams: int = Field(2, ge=1)
    snapshot_dir: Path | None = None
    snapshot_every_records: int = Field(200_000, ge=0)
    snapshot_every_s: float = Field(60.0, ge=0)
    ready_max_lag: int = Field(1000, ge=0)
    #: Once ready, refuse routing (503) while behind the log or cut off from the broker,
    #: instead of routing with each decision marked stale.
    refuse_when_stale: bool = False
    tick_interval_s: float = Field(5.0, gt=0)
    #: Names the replica in logs, ticks and its consumer group ``kvstream-<replica_id>``,
    #: where it commits its read positions (for kafka-consumer-groups); keep it stable
    #: across restarts (e.g. the host name). Default: random per start.
    replica_id: str = Field(default_factory=lambda: f"replica-{uuid.uuid4().hex[:12]}", min_length=1)
    #: Commit read positions this often (s); 0: never.
    commit_interval_s: float = Field(1.0, ge=0)
    #: After a recovery that dropped workers, stay unready until they resync, at most this long.
    resync_wait_s: float = Field(10.0, ge=0)
    peer_url: str | None = None

    @model_validator(mode="after")
    def _budget_holds_a_body(self) -> ReplicaSettings:
        if self.max_buffered_body_bytes < self.max_body_bytes:
            raise ValueError(
                f"max_buffered_body_bytes ({self.max_buffered_body_bytes}) must be at least "
                f"max_body_bytes ({self.max_body_bytes}): a body of the largest size could never be read"
            )
        return self


class FoldSettings(Section):
    """What a replica (and ``kvstream replay``) accepts from the events topic; every
    replica of a deployment must use the same values, or they disagree
    (kvstream.replica.authority; docs/RELIABILITY.md, "Threat model"). 0: no limit."""

    #: A batch's record key must be its worker id (8 big-endian bytes, as published).
    check_key: bool = True
    #: A wall-clock epoch (ns) may be at most this far ahead of its record's time; -1: off.
    max_epoch_ahead_ms: int = Field(300_000, ge=-1)
    #: Longest lease a batch may ask for (a phantom's lease is how long it holds a slot).
    max_lease_ms: int = Field(0, ge=0)
    max_blocks_per_event: int = Field(65_536, ge=0)
    #: Sized from a real engine (kvstream.replica.authority.DEFAULT_BLOCKS_PER_WORKER);
    #: a worker with a larger cache (a big disk tier) needs it raised.
    max_blocks_per_worker: int = Field(1 << 20, ge=0)
    #: The fleet-wide budget, kept per partition so that every replica decides alike
    #: (the fleet holds at most this times the partition count); counted when it bites.
    max_blocks_per_partition: int = Field(1 << 22, ge=0)
    max_workers_per_partition: int = Field(1024, ge=0)
    #: Only these worker ids are accepted (unset: any).
    allowed_workers: list[int] | None = None


class WorkerSettings(Section):
    """How ``kvstream worker`` consolidates and publishes (DESIGN.md §2, §3)."""

    #: ``dedup`` (one merged device residency) or ``passthrough`` (every tier).
    mode: Literal["dedup", "passthrough"] = "dedup"
    #: Routers keep a silent worker this long (log time); must outlast the heartbeat.
    lease_ms: int = Field(10_000, ge=1)
    heartbeat_s: float = Field(2.0, gt=0)
    #: How long events wait to share a Kafka message.
    linger_ms: float = Field(5.0, ge=0)
    #: A full producer queue blocks the worker (``block``) or fails it (``fail``).
    queue_full: Literal["block", "fail"] = "block"
    #: Prometheus port; 0: none.
    metrics_port: int = Field(0, ge=0, le=65535)
    #: Engine bridge: where it keeps its state across restarts (None: it does not).
    state_dir: str | None = None
    #: Engine bridge: checkpoint period (s), when the state changed.
    checkpoint_s: float = Field(10.0, gt=0)
    #: Engine bridge: vLLM's offloading ``blocks_per_chunk`` (its placeholder events
    #: name a chunk by its last block; docs/ENGINES.md).
    offload_blocks_per_chunk: int = Field(1, ge=1)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="KVSTREAM_", env_nested_delimiter="__", extra="forbid"
    )

    #: Kafka bootstrap servers; unset means the local development broker (kvstream broker).
    bootstrap: str | None = None
    #: librdkafka options passed through to every client (security.protocol, sasl.*, ssl.*).
    kafka_options: dict[str, str] = Field(default_factory=dict)
    topics: TopicSettings = Field(default_factory=TopicSettings)
    router: RouterSettings = Field(default_factory=RouterSettings)
    replica: ReplicaSettings = Field(default_factory=ReplicaSettings)
    worker: WorkerSettings = Field(default_factory=WorkerSettings)
    fold: FoldSettings = Field(default_factory=FoldSettings)
    #: The OpenAI gateway of ``kvstream router`` (``[gateway]``, ``[[gateway.workers]]``):
    #: validated as kvstream.gateway.options.GatewayOptions, where each option is defined.
    gateway: GatewayOptions = Field(default_factory=GatewayOptions)
    log_level: str = "INFO"
    #: ``json`` for machines, ``console`` for people.
    log_format: str = "console"

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        if _config_file is not None:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=_config_file))
        return tuple(sources)


#: ``KVSTREAM_*`` variables that are not settings: the scripts', the tests' and the
#: images' own (a prefix ending in ``_`` covers a family).
OTHER_VARIABLES = (
    "KVSTREAM_CONFIG", "KVSTREAM_CACHE", "KVSTREAM_ROOT", "KVSTREAM_TOKEN", "KVSTREAM_TEST_", "KVSTREAM_KAFKA_",
    "KVSTREAM_BROKER_", "KVSTREAM_ROUTER1_", "KVSTREAM_ROUTER2_", "KVSTREAM_GPU_", "KVSTREAM_ENGINE_",
    "KVSTREAM_DOCKER_", "KVSTREAM_DEBIAN_",
)
#: Parts of a key whose value is never echoed in an error or by ``config show``.
SECRET_WORDS = ("token", "password", "secret", "key")


def _config_path(config: str | Path | None) -> Path | None:
    path = config or os.environ.get("KVSTREAM_CONFIG")
    return Path(path) if path else None


def load_settings(config: str | Path | None = None, **overrides: Any) -> Settings:
    """Settings from flags (``overrides``, None values ignored), env and the TOML file."""
    global _config_file, _warned
    if not _warned:
        _warned = True
        from kvstream.logs import get_logger

        for var in unknown_variables():
            get_logger(__name__).warning("unknown variable: it sets nothing", variable=var)
    _config_file = _config_path(config)
    if _config_file is not None and not _config_file.is_file():
        raise SettingsError(f"config file {_config_file} does not exist")
    try:
        return Settings(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:
        raise SettingsError(explain(exc)) from None
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"config file {_config_file} is not valid TOML: {exc}") from None
    finally:
        _config_file = None


def explain(exc: ValidationError, section: tuple[str, ...] = ()) -> str:
    """One line per problem: which key, why, and for an unknown key the nearest valid one;
    a secret's value is never shown. ``section``: where the validated model sits."""
    lines = []
    for e in exc.errors():
        loc = [*section, *(str(p) for p in e["loc"])]
        where = ".".join(loc)
        if e["type"] == "extra_forbidden":
            valid = _keys_at(loc[:-1])
            close = difflib.get_close_matches(loc[-1], valid, n=1, cutoff=0.6)
            hint = f" (did you mean `{'.'.join([*loc[:-1], close[0]])}`?)" if close else ""
            lines.append(f"unknown setting `{where}`{hint}")
            continue
        value = "" if is_secret(where) or isinstance(e.get("input"), dict) else f" (got {e.get('input')!r})"
        lines.append(f"`{where}`: {e['msg']}{value}")
    return "invalid settings: " + "; ".join(lines)


def is_secret(key: str) -> bool:
    # librdkafka's passthrough may hold credentials under any name (sasl.jaas.config).
    return key.startswith("kafka_options") or any(word in key.lower() for word in SECRET_WORDS)


def _keys_at(loc: list[str]) -> list[str]:
    """The valid keys of the section at ``loc`` (a list of field names)."""
    model: Any = Settings
    for name in loc:
        field = getattr(model, "model_fields", {}).get(name)
        if field is None:
            return []
        model = field.annotation
    return list(getattr(model, "model_fields", {}))


def unknown_variables(environ: dict[str, str] | None = None) -> list[str]:
    """``KVSTREAM_*`` variables that set nothing, each with the nearest setting when one
    is close (pydantic-settings ignores an unknown top-level name silently)."""
    env = os.environ if environ is None else environ
    names = [f"KVSTREAM_{n.upper()}" for n in Settings.model_fields]
    out = []
    for var in sorted(env):
        if not var.startswith("KVSTREAM_") or var.startswith(OTHER_VARIABLES):
            continue
        top = var.split("__")[0]
        if top in names:
            continue
        close = difflib.get_close_matches(top, names, n=1, cutoff=0.6)
        out.append(f"{var}" + (f" (did you mean {close[0]}?)" if close else ""))
    return out


def origins(config: str | Path | None = None, **overrides: Any) -> dict[str, tuple[Any, str]]:
    """Every effective setting (dotted key → (value, where it came from: ``flag``,
    ``env``, ``toml``, ``default``)), secrets masked: what ``kvstream config show`` prints."""
    settings = load_settings(config, **overrides)
    path = _config_path(config)
    toml = TomlConfigSettingsSource(Settings, toml_file=path)() if path is not None else {}
    env = EnvSettingsSource(Settings, env_prefix="KVSTREAM_", env_nested_delimiter="__")()
    flags = {k: v for k, v in overrides.items() if v is not None}

    def has(doc: Any, keys: list[str]) -> bool:
        for k in keys:
            if not isinstance(doc, dict) or k not in doc:
                return False
            doc = doc[k]
        return True

    out: dict[str, tuple[Any, str]] = {}

    def walk(doc: dict[str, Any], prefix: list[str]) -> None:
        for k, v in doc.items():
            keys = [*prefix, k]
            if isinstance(v, dict) and keys[0] != "kafka_options" or (keys == ["kafka_options"] and v and isinstance(v, dict)):
                walk(v, keys)
                continue
            source = next((name for name, doc_ in (("flag", flags), ("env", env), ("toml", toml)) if has(doc_, keys)), "default")
            dotted = ".".join(keys)
            out[dotted] = ("***" if is_secret(dotted) and v is not None else v, source)

    walk(settings.model_dump(mode="json"), [])
    return out
