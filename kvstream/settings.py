"""One typed settings object for every command: flags > ``KVSTREAM_*`` env > TOML > defaults.

Nested sections are set from the environment with a double underscore, e.g.
``KVSTREAM_ROUTER__HOST_CACHE_HIT_WEIGHT=0.5``; the TOML file uses ``[router]``.
The file is named by ``--config`` or ``KVSTREAM_CONFIG``. An unknown key at any level is
an error that names the nearest valid one (a typo must never pass silently); an unknown
``KVSTREAM_*`` variable is warned about. ``kvstream config show`` prints the effective
settings and where each came from.

A section is defined by frozen option dataclasses (kvstream.options): ``[replica]`` by
kvstream.replica.options, ``[worker]`` by kvstream.worker.options, ``[gateway]`` by
kvstream.gateway.options (validated as the dataclass itself). :func:`section` derives a
section from them and ``Section.to_options`` gives each dataclass back, so that a key
cannot exist on one side only. ``[topics]`` and ``[fold]`` are written out here: no
dataclass repeats them (the fold's kvstream.replica.authority.LogAuthority is built by
``authority_from_settings``); ``[router]`` too for now, pinned to the router's
SchedulerConfig by tests/settings/test_one_definition.py.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import tomllib
from dataclasses import MISSING
from pathlib import Path
from types import UnionType
from typing import Any, ClassVar, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from kvstream.gateway.options import GatewayOptions
from kvstream.hashing import DEFAULT_BLOCK_SIZE
from kvstream.logs import DEFAULT_FORMAT, DEFAULT_LEVEL, FORMATS, LEVELS, get_logger
from kvstream.options import is_internal
from kvstream.replica.options import HttpLimits, ReplicaOptions, ServerOptions
from kvstream.router.active import DEFAULT_TTL_S
from kvstream.router.index import DEFAULT_EXPECTED_BLOCKS, DEFAULT_EXPECTED_TTL_S
from kvstream.router.scheduler import config_fields
from kvstream.worker.options import WorkerOptions

T = TypeVar("T")

_config_file: Path | None = None
_warned = False  # unknown KVSTREAM_* variables are reported once per process


class SettingsError(ValueError):
    """Settings that cannot be loaded; the message says which and why."""


class Section(BaseModel):
    """A section of the settings: an unknown key in it is an error, not ignored."""

    model_config = ConfigDict(extra="forbid")

    #: Of a section made by :func:`section`: each option dataclass → its keys here.
    option_keys: ClassVar[dict[type, tuple[str, ...]]] = {}

    def to_options(self, cls: type[T], **internal: Any) -> T:
        """The option dataclass ``cls`` this section is derived from, with this section's
        values; ``internal`` sets fields that are no settings (kvstream.options.internal)."""
        keys = type(self).option_keys.get(cls)
        if keys is None:
            raise TypeError(f"{type(self).__name__} is not derived from {cls.__name__}")
        settable = {f.name for f in dataclasses.fields(cls) if is_internal(f)}
        if not settable.issuperset(internal):
            raise TypeError(f"{cls.__name__}: {sorted(set(internal) - settable)} are settings, not internal fields")
        return cls(**{k: getattr(self, k) for k in keys}, **internal)

    @model_validator(mode="after")
    def _options_hold(self) -> Section:
        # The dataclasses' own checks (__post_init__) at load time, with the key's section
        # in the message, rather than at first use; one that needs an internal value
        # without a default is checked when code makes it.
        for cls in type(self).option_keys:
            if all(f.default is not MISSING or f.default_factory is not MISSING
                   for f in dataclasses.fields(cls) if is_internal(f)):
                self.to_options(cls)
        return self


def section(name: str, doc: str, *options: type) -> type[Section]:
    """A section whose keys are the fields of the frozen option dataclasses ``options``
    (name, type with its bounds, default: defined there once), less their internal
    ones. A key two of them define is an error here, at import."""
    fields_: dict[str, Any] = {}
    keys: dict[type, tuple[str, ...]] = {}
    for cls in options:
        hints = get_type_hints(cls, include_extras=True)
        own = [f for f in dataclasses.fields(cls) if not is_internal(f)]
        for f in own:
            if f.name in fields_:
                raise TypeError(f"{name}: `{f.name}` is defined by two of {[c.__name__ for c in options]}")
            # A secret's repr=False holds for the section too.
            if f.default_factory is not MISSING:
                spec = Field(default_factory=f.default_factory, repr=f.repr)
            else:
                spec = Field(... if f.default is MISSING else f.default, repr=f.repr)
            fields_[f.name] = (hints[f.name], spec)
        keys[cls] = tuple(f.name for f in own)
    model = create_model(name, __base__=Section, __doc__=doc, __module__=__name__, **fields_)
    model.option_keys = keys
    return model


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
    #: The compacted worker registry (kvstream.replica.registry): a handful of records.
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
    #: A routed prompt's blocks are expected on its worker (counted as cached there) until
    #: the engine's events confirm them, its request fails, or this many seconds pass;
    #: a worker without events is routed by them alone (approximate mode, issue 33).
    expected_ttl_s: float = Field(DEFAULT_EXPECTED_TTL_S, gt=0, allow_inf_nan=False)
    #: Most blocks expected per worker rank whose registration gives no device capacity.
    expected_blocks: int = Field(DEFAULT_EXPECTED_BLOCKS, ge=0)
    #: Only workers with a live registration on kvstream.workers (or listed in
    #: ``[[gateway.workers]]``) may win a ``POST /v1/route``: a worker id that only ever
    #: published events is a phantom (kvstream.replica.admission). Turn it off only for a
    #: fleet whose bridges do not register; every replica and ``kvstream replay`` of a
    #: deployment must agree on it.
    require_registration: bool = True


RouterSettings = create_model("RouterSettings", __base__=_RouterSection, **_scheduler_settings())


ReplicaSettings = section(
    "ReplicaSettings", "How ``kvstream router`` runs a replica (DESIGN.md §7, §9).",
    ServerOptions, HttpLimits, ReplicaOptions,
)


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


WorkerSettings = section("WorkerSettings", "How ``kvstream worker`` consolidates and publishes.", WorkerOptions)


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
    #: What the commands that read the settings (``kvstream router``, ``kvstream worker``)
    #: log; ``kvstream --log-level`` / ``KVSTREAM_LOG_LEVEL`` win over the TOML file.
    log_level: Literal[LEVELS] = DEFAULT_LEVEL
    #: ``json`` for machines, ``console`` for people (``--log-format``, ``KVSTREAM_LOG_FORMAT``).
    log_format: Literal[FORMATS] = DEFAULT_FORMAT

    @model_validator(mode="after")
    def _load_outlives_restarts(self) -> Settings:
        # A (re)started replica rebuilds load and predictions from the last request_ttl_s
        # (expected_ttl_s) of kvstream.active.
        for name, what in (("request_ttl_s", "the load of the requests"), ("expected_ttl_s", "the predicted blocks")):
            ttl = getattr(self.router, name)
            if ttl * 1000 > self.topics.active_retention_ms:
                raise ValueError(
                    f"router.{name} ({ttl:g} s) is longer than topics.active_retention_ms "
                    f"({self.topics.active_retention_ms} ms): a restarted replica could not rebuild {what} "
                    "older than the retention"
                )
        return self

    @field_validator("log_level", mode="before")
    @classmethod
    def _any_case(cls, value: Any) -> Any:
        return value.upper() if isinstance(value, str) else value

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
        # A model says extra_forbidden; a dataclass validated as one (GatewayOptions), the other.
        if e["type"] in ("extra_forbidden", "unexpected_keyword_argument"):
            valid = _keys_at(loc[:-1])
            close = difflib.get_close_matches(loc[-1], valid, n=1, cutoff=0.6)
            hint = f" (did you mean `{'.'.join([*loc[:-1], close[0]])}`?)" if close else ""
            lines.append(f"unknown setting `{where}`{hint}")
            continue
        value = "" if is_secret(where) or isinstance(e.get("input"), dict) else f" (got {e.get('input')!r})"
        lines.append(f"`{where}`: {e['msg']}{value}" if where else e["msg"].removeprefix("Value error, "))
    return "invalid settings: " + "; ".join(lines)


def is_secret(key: str) -> bool:
    # librdkafka's passthrough may hold credentials under any name (sasl.jaas.config).
    return key.startswith("kafka_options") or any(word in key.lower() for word in SECRET_WORDS)


def _keys_at(loc: list[str]) -> list[str]:
    """The valid keys of the section at ``loc`` (field names, and indexes into a list of
    entries such as ``[[gateway.workers]]``)."""
    kind: Any = Settings
    for name in loc:
        if name.isdigit():
            kind = next((a for a in get_args(kind) if a is not Ellipsis), None)
        else:
            kind = _fields_of(kind).get(name)
    return list(_fields_of(kind))


def _fields_of(kind: Any) -> dict[str, Any]:
    """A section's keys → their types: a settings model's, or a validated dataclass's."""
    if get_origin(kind) in (Union, UnionType):  # an optional section
        kind = next(a for a in get_args(kind) if a is not type(None))
    if isinstance(kind, type) and issubclass(kind, BaseModel):
        return {k: f.annotation for k, f in kind.model_fields.items()}
    if dataclasses.is_dataclass(kind):
        return get_type_hints(kind)
    return {}


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
