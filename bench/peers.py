"""The peer routers the benchmarks run beside kvstream: ``sglang-router`` (the SGLang
model gateway) and ``vllm-router``, both Rust HTTP proxies on PyPI, pinned here.

They are installed on first use into their own virtual environment,
``$KVSTREAM_PEER_CACHE`` or ``~/.cache/kvstream/peers/<hash of the pins>/`` (kept; a
version bump makes a new one), and started on a free loopback port in front of a list of
OpenAI-compatible backends (:func:`start_peer`), each in its own process group
(kvstream.tools.procs: stopped at the end of the block, at exit, on Ctrl-C and on
SIGTERM). What they ask of a backend, as seen with kvstream's bench backend:

- ``sglang-router``: ``/health`` (and, at startup, ``/get_server_info``,
  ``/get_model_info``; a 404 there is fine), then the request itself;
- ``vllm-router``: ``/health``; under ``cache_aware`` and ``kv_aware`` also, for every
  request, ``/v1/completions/render`` (``/v1/chat/completions/render`` for chat) on every
  worker before the request itself (``round_robin`` renders nothing). ``kv_aware`` reads each worker's vLLM KV
  events over ZMQ: ``--kv-event-source WORKER_URL=tcp://HOST:PORT`` per worker (the URL
  exactly as given in ``--worker-urls``; several endpoints, comma-separated, are its DP
  ranks), with ``--kv-event-model`` (required) and ``--kv-event-block-size``. It
  subscribes (the engine binds), and matches the rendered token ids against the token
  ids of the events' ``BlockStored`` (the events' block hashes only name the blocks):
  a render and the events must agree on the tokens.
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import click

from bench.venvs import cached_venv
from kvstream.tools.procs import HOST, ManagedProcess, free_port, wait_http

SGLANG_ROUTER_VERSION = "0.3.2"
VLLM_ROUTER_VERSION = "0.1.17"
_REQUIREMENTS = (f"sglang-router=={SGLANG_ROUTER_VERSION}", f"vllm-router=={VLLM_ROUTER_VERSION}")

#: The policies each peer is run with, per peer.
POLICIES: dict[str, tuple[str, ...]] = {
    "sglang-router": ("cache_aware", "round_robin"),
    "vllm-router": ("cache_aware", "round_robin", "kv_aware"),
}
#: vLLM's default KV block size (what ``--kv-event-block-size`` must match).
KV_EVENT_BLOCK_SIZE = 16


def cache_root() -> Path:
    return Path(os.environ.get("KVSTREAM_PEER_CACHE", Path.home() / ".cache" / "kvstream" / "peers"))


def _venv_dir() -> Path:
    tag = "\n".join((*_REQUIREMENTS, sys.version.split()[0])).encode()
    return cache_root() / hashlib.sha256(tag).hexdigest()[:12]


def peers_venv() -> Path:
    """The peers' virtual environment, created and filled on first use."""
    return cached_venv("the peer routers", _venv_dir(), _REQUIREMENTS)


@dataclass(frozen=True, slots=True)
class PeerOptions:
    """One peer router in front of ``workers`` (base URLs, no ``/v1``)."""

    peer: str
    policy: str
    workers: tuple[str, ...]
    #: ``kv_aware`` only: each worker's ZMQ KV-event endpoint (``tcp://host:port``).
    kv_events: Mapping[str, str] | None = None
    #: ``kv_aware`` only: the model every event source serves.
    kv_event_model: str | None = None
    kv_event_block_size: int = KV_EVENT_BLOCK_SIZE

    def __post_init__(self) -> None:
        if self.peer not in POLICIES:
            raise click.ClickException(f"unknown peer {self.peer!r}; known: {', '.join(POLICIES)}")
        if self.policy not in POLICIES[self.peer]:
            raise click.ClickException(
                f"{self.peer} is run with policy {', '.join(POLICIES[self.peer])}, not {self.policy!r}"
            )
        if not self.workers:
            raise click.ClickException(f"{self.peer} needs at least one worker URL")
        if self.policy == "kv_aware":
            missing = [w for w in self.workers if w not in (self.kv_events or {})]
            if missing or not self.kv_event_model:
                raise click.ClickException(
                    "vllm-router kv_aware needs a ZMQ event endpoint for every worker and the model name "
                    f"(missing endpoints: {missing}, model: {self.kv_event_model!r})"
                )

    @property
    def name(self) -> str:
        return f"{self.peer}-{self.policy}"


def peer_command(options: PeerOptions, venv: Path, port: int, metrics_port: int) -> list[str]:
    """The command line that starts the peer on ``port`` (loopback only; its Prometheus
    endpoint on ``metrics_port``, as both default to one shared port, 29000)."""
    common = [
        "--host", HOST, "--port", str(port), "--worker-urls", *options.workers, "--policy", options.policy,
        "--prometheus-host", HOST, "--prometheus-port", str(metrics_port),
    ]
    if options.peer == "sglang-router":
        # Per-request INFO logs would be part of what is measured.
        return [str(venv / "bin" / "sglang-router"), "launch", *common, "--log-level", "warn"]
    cmd = [str(venv / "bin" / "vllm-router"), *common, "--log-level", "warning"]
    if options.policy == "kv_aware":
        assert options.kv_events is not None and options.kv_event_model is not None
        for worker in options.workers:
            cmd += ["--kv-event-source", f"{worker}={options.kv_events[worker]}"]
        cmd += ["--kv-event-model", options.kv_event_model, "--kv-event-block-size", str(options.kv_event_block_size)]
    return cmd


def launch_peer(options: PeerOptions, port: int | None = None, metrics_port: int | None = None,
                ready_timeout: float = 60.0, restart: bool = False) -> ManagedProcess:
    """The peer, serving on ``port`` (refused if taken, unless ``restart``: the same
    ports as a killed predecessor's; default: free ports) once its ``/health`` answers.
    The caller stops it."""
    venv = peers_venv()
    port = free_port() if port is None else port
    metrics_port = free_port() if metrics_port is None else metrics_port
    proc = ManagedProcess.start(
        options.name, peer_command(options, venv, port, metrics_port), port, extra_ports=[metrics_port],
        env={"NO_COLOR": "1"}, restart=restart,
    )
    try:
        wait_http(proc, "/health", ready_timeout)
    except BaseException:
        proc.stop()
        raise
    return proc


@contextmanager
def start_peer(options: PeerOptions, port: int | None = None, ready_timeout: float = 60.0) -> Iterator[ManagedProcess]:
    """The peer, serving on ``port`` (refused if taken; default: a free port) once its
    ``/health`` answers; stopped with everything it started when the block ends."""
    proc = launch_peer(options, port, ready_timeout=ready_timeout)
    try:
        yield proc
    finally:
        proc.stop()


def peer_versions() -> dict[str, str]:
    return {"sglang-router": SGLANG_ROUTER_VERSION, "vllm-router": VLLM_ROUTER_VERSION}

