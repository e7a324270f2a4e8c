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

Disaggregated (prefill/decode) mode, ``PeerOptions.decode`` given (``workers`` are then
the prefill workers), as seen with a stub worker logging what it is sent and with the
emulator:

- ``sglang-router launch --pd-disaggregation --prefill URL BOOTSTRAP_PORT … --decode URL
  …``: at startup ``/health``, ``/server_info``, ``/get_server_info``, ``/model_info``,
  ``/get_model_info`` on every worker (404s are fine); per request both legs at once, the
  client's body with ``bootstrap_host`` (the prefill URL's host), ``bootstrap_port`` and
  one ``bootstrap_room``, plus SGLang's own fields (``no_stop_trim``,
  ``return_hidden_states``, ``skip_special_tokens``, ``ignore_eos``, ``echo``); the decode
  leg's answer is the client's (SGLang's bootstrap hand-off);
- ``vllm-router --vllm-pd-disaggregation --prefill URL … --decode URL … --kv-connector
  nixl``: ``/health`` and ``/metrics`` (DP discovery) at startup; per request the render
  (on every worker under ``cache_aware``, on the prefill workers under ``kv_aware``), then
  the prefill leg (``kv_transfer_params.do_remote_decode``, ``max_tokens`` 1, not
  streamed), then the decode leg with the prefill answer's ``kv_transfer_params``
  (vLLM's NixlConnector hand-off); the client's answer is the decode leg's, but its
  ``usage.prompt_tokens_details.cached_tokens`` is the prefill leg's. ``kv_aware`` reads
  the prefill workers' KV events: ``--pd-kv-events WORKER_URL=tcp://HOST:PORT``.

``kvstream emulate --role prefill|decode`` answers both (``kvstream bench fleet --pd``).
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
#: The KV hand-off each peer drives between a prefill and a decode engine (PD mode).
HANDOFFS = {"sglang-router": "bootstrap", "vllm-router": "nixl"}
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
    """One peer router in front of ``workers`` (base URLs, no ``/v1``); with ``decode``, in
    PD mode: ``workers`` are the prefill workers."""

    peer: str
    policy: str
    workers: tuple[str, ...]
    #: ``kv_aware`` only: each (prefill) worker's ZMQ KV-event endpoint (``tcp://host:port``).
    kv_events: Mapping[str, str] | None = None
    #: ``kv_aware`` only: the model every event source serves.
    kv_event_model: str | None = None
    kv_event_block_size: int = KV_EVENT_BLOCK_SIZE
    #: PD mode: the decode workers.
    decode: tuple[str, ...] = ()
    #: PD mode, ``bootstrap`` hand-off (sglang-router): each prefill worker's bootstrap port.
    bootstrap_ports: Mapping[str, int] | None = None

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
        if self.decode and HANDOFFS[self.peer] == "bootstrap":
            missing = [w for w in self.workers if w not in (self.bootstrap_ports or {})]
            if missing:
                raise click.ClickException(f"{self.peer} in PD mode needs every prefill worker's bootstrap port "
                                           f"(missing: {missing})")

    @property
    def name(self) -> str:
        return f"{self.peer}-{self.policy}"


def peer_command(options: PeerOptions, venv: Path, port: int, metrics_port: int) -> list[str]:
    """The command line that starts the peer on ``port`` (loopback only; its Prometheus
    endpoint on ``metrics_port``, as both default to one shared port, 29000)."""
    if options.decode:
        ports = options.bootstrap_ports or {}
        workers = [a for w in options.workers for a in ("--prefill", w, *([str(ports[w])] if w in ports else []))]
        workers += [a for w in options.decode for a in ("--decode", w)]
    else:
        workers = ["--worker-urls", *options.workers]
    common = [
        "--host", HOST, "--port", str(port), *workers, "--policy", options.policy,
        "--prometheus-host", HOST, "--prometheus-port", str(metrics_port),
    ]
    if options.peer == "sglang-router":
        # Per-request INFO logs would be part of what is measured.
        pd = ["--pd-disaggregation"] if options.decode else []
        return [str(venv / "bin" / "sglang-router"), "launch", *pd, *common, "--log-level", "warn"]
    cmd = [str(venv / "bin" / "vllm-router"), *common, "--log-level", "warning"]
    if options.decode:
        cmd += ["--vllm-pd-disaggregation", "--kv-connector", HANDOFFS[options.peer],
                "--prefill-policy", options.policy, "--decode-policy", options.policy]
    if options.policy == "kv_aware":
        assert options.kv_events is not None and options.kv_event_model is not None
        # PD mode reads the prefill workers' events only, at vLLM's block size.
        flag = "--pd-kv-events" if options.decode else "--kv-event-source"
        for worker in options.workers:
            cmd += [flag, f"{worker}={options.kv_events[worker]}"]
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

