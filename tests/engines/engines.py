"""The engines' own KV-event code, from their pinned PyPI wheels, without the engines.

The wheels are fetched with ``pip download --no-deps`` into a cache (reused:
``$KVSTREAM_ENGINE_CACHE`` or ``~/.cache/kvstream/engines``); only the KV-event modules
are extracted and imported, under their real module names, with msgspec and pyzmq.
What those modules import from the rest of the engine (logging, config decorators,
network helpers, a type alias) is replaced by the smallest stand-ins below; none of
them takes part in encoding or publishing events.

Upgrading an engine is a version bump here and a test run.
"""

from __future__ import annotations

import dataclasses
import fcntl
import importlib.util
import logging
import os
import subprocess
import sys
import time
import types
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

VLLM_VERSION = "0.33.0"
SGLANG_VERSION = "0.5.23"

#: Files of each wheel that are imported (module name → path in the wheel).
_MODULES = {
    "vllm": {
        "vllm.config.kv_events": "vllm/config/kv_events.py",
        "vllm.distributed.kv_events": "vllm/distributed/kv_events.py",
    },
    "sglang": {
        "sglang.srt.disaggregation.kv_events": "sglang/srt/disaggregation/kv_events.py",
    },
}


class EngineUnavailable(RuntimeError):
    """A pinned wheel could not be fetched or read."""


def cache_dir() -> Path:
    return Path(os.environ.get("KVSTREAM_ENGINE_CACHE", Path.home() / ".cache" / "kvstream" / "engines"))


def _wheel(name: str, version: str) -> Path:
    """The wheel of ``name==version`` in the cache, downloaded once (no dependencies)."""
    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    # One download at a time (pytest-xdist workers, parallel sessions).
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        found = sorted(cache.glob(f"{name}-{version}-*.whl"))
        if not found:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                   "--disable-pip-version-check", "-q", "-d", str(cache), f"{name}=={version}"]
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
            found = sorted(cache.glob(f"{name}-{version}-*.whl"))
            if run.returncode != 0 or not found:
                raise EngineUnavailable(
                    f"cannot fetch {name}=={version} from PyPI ({' '.join(cmd)}): {run.stderr.strip()[-2000:]}"
                )
    return found[0]


def _extract(name: str, version: str) -> Path:
    """The wheel's KV-event files, under ``<cache>/<name>-<version>/``."""
    for p in _MODULES[name].values():
        _extract_file(name, version, p)
    return cache_dir() / f"{name}-{version}"


def _extract_file(name: str, version: str, path: str) -> Path:
    """One file of the wheel, extracted once under ``<cache>/<name>-<version>/``."""
    target = cache_dir() / f"{name}-{version}" / path
    if target.is_file():
        return target
    wheel = _wheel(name, version)
    try:
        with zipfile.ZipFile(wheel) as zf:
            data = zf.read(path)
    except (zipfile.BadZipFile, KeyError) as exc:
        raise EngineUnavailable(f"{wheel}: {exc} (delete it to fetch it again)") from None
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".tmp")
    tmp.write_bytes(data)
    tmp.replace(target)
    return target


def wheel_source(name: str, path: str) -> str:
    """The text of one file of the pinned ``vllm`` or ``sglang`` wheel (``path`` in the
    wheel), for tests that read an engine's source (with ``ast``) without importing it."""
    return _extract_file(name, VLLM_VERSION if name == "vllm" else SGLANG_VERSION, path).read_text()


def _module(name: str, package: bool = False, **attrs: Any) -> types.ModuleType:
    mod = sys.modules.get(name)
    if mod is None:
        mod = types.ModuleType(name)
        if package:
            mod.__path__ = []  # a namespace with no files: only what we register
        sys.modules[name] = mod
    mod.__dict__.update(attrs)
    return mod


def _load(name: str, path: Path) -> types.ModuleType:
    if name in sys.modules and getattr(sys.modules[name], "__file__", None) == str(path):
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _not_needed(what: str) -> Any:
    def stand_in(*_: Any, **__: Any) -> Any:
        raise NotImplementedError(f"{what} is not part of the KV-event stand-ins")

    return stand_in


def load_vllm() -> types.ModuleType:
    """``vllm.distributed.kv_events`` of the pinned wheel."""
    root = _extract("vllm", VLLM_VERSION)
    for pkg in ("vllm", "vllm.config", "vllm.distributed", "vllm.utils", "vllm.v1", "vllm.v1.core"):
        _module(pkg, package=True)
    # vllm.config.utils.config turns a class into a pydantic dataclass (and imports torch).
    _module("vllm.config.utils", config=dataclasses.dataclass)
    _module("vllm.logger", init_logger=logging.getLogger)
    # Used only to bind tcp://*:0 to the node's IP.
    _module(
        "vllm.utils.network_utils",
        get_ip=_not_needed("get_ip"),
        get_tcp_uri=_not_needed("get_tcp_uri"),
        is_valid_ipv6_address=_not_needed("is_valid_ipv6_address"),
        split_zmq_path=_not_needed("split_zmq_path"),
    )
    _module("vllm.v1.core.kv_cache_utils", ExternalBlockHash=bytes | int)
    for name, rel in _MODULES["vllm"].items():
        _load(name, root / rel)
    return sys.modules["vllm.distributed.kv_events"]


def load_sglang() -> types.ModuleType:
    """``sglang.srt.disaggregation.kv_events`` of the pinned wheel."""
    root = _extract("sglang", SGLANG_VERSION)
    for pkg in ("sglang", "sglang.srt", "sglang.srt.disaggregation", "sglang.srt.utils"):
        _module(pkg, package=True)
    # Used by its scheduler-side helpers and endpoint advertising, not by the publisher.
    _module("sglang.srt.runtime_context", get_parallel=_not_needed("get_parallel"))
    _module("sglang.srt.utils.network", NetworkAddress=type("NetworkAddress", (), {"parse": _not_needed("parse")}))
    for name, rel in _MODULES["sglang"].items():
        _load(name, root / rel)
    return sys.modules["sglang.srt.disaggregation.kv_events"]


@dataclass(frozen=True)
class EngineKit:
    """One engine's KV-event module, behind the few calls the tests make."""

    name: str
    mod: types.ModuleType

    @property
    def version(self) -> str:
        return VLLM_VERSION if self.name == "vllm" else SGLANG_VERSION

    def publisher(self, rank: int, port: int, replay_port: int | None, **kw: Any) -> Any:
        """The engine's own ZmqEventPublisher for DP rank ``rank``, bound on loopback
        at ``port`` (+ rank, the engine's own offset) like a real deployment."""
        endpoint = f"tcp://*:{port}"
        replay = f"tcp://*:{replay_port}" if replay_port is not None else None
        # The rank is vLLM's data_parallel_rank, SGLang's attn_dp_rank: both positional.
        return self.mod.ZmqEventPublisher(rank, endpoint=endpoint, replay_endpoint=replay, **kw)

    def batch(self, events: list[Any]) -> Any:
        return self.mod.KVEventBatch(ts=time.time(), events=events)

    def stored(
        self,
        hashes: list[Any],
        parent: Any,
        tokens: list[int],
        block_size: int = 16,
        *,
        medium: str | None = "GPU",
        lora_name: str | None = None,
        lora_id: int | None = None,
        **extra: Any,
    ) -> Any:
        common = dict(
            block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=block_size,
            lora_id=lora_id, medium=medium, lora_name=lora_name,
        )
        return self.mod.BlockStored(**common, **extra)

    def removed(self, hashes: list[Any], *, medium: str | None = "GPU", **extra: Any) -> Any:
        return self.mod.BlockRemoved(block_hashes=hashes, medium=medium, **extra)

    def cleared(self) -> Any:
        return self.mod.AllBlocksCleared()

    @property
    def host_medium(self) -> str:
        """How the engine names its host-memory tier."""
        return "CPU" if self.name == "vllm" else self.mod.StorageMedium.CPU.value


def kit(name: str) -> EngineKit:
    return EngineKit(name, load_vllm() if name == "vllm" else load_sglang())
