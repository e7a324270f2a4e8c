"""``kvstream router``: one router process, composed: the replica (kvstream.replica: consume,
fold, snapshot), its HTTP API (kvstream.replica.service) and, when enabled, the OpenAI
gateway (kvstream.gateway) mounted on it. The composition lives here, above both, so
that the replica knows nothing of the gateway built on its facade."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import click
import uvicorn
from pydantic import ValidationError

from kvstream.gateway.errors import GatewayError
from kvstream.gateway.options import GatewayOptions
from kvstream.logs import configure_logging, get_logger, logging_flags
from kvstream.replica.auth import TokenError
from kvstream.replica.cli import freeze_heap, http_limits, is_loopback, replica_options, router_config, server_config, tokens
from kvstream.replica.errors import ReplicaError
from kvstream.replica.options import ServerOptions
from kvstream.replica.replica import Replica
from kvstream.settings import ReplicaSettings, SettingsError, explain, load_settings

if TYPE_CHECKING:
    from kvstream.gateway.app import Gateway

log = get_logger(__name__)

#: The defaults the flags' help shows.
_SERVER = ServerOptions()


def gateway_for(replica: Replica, options: GatewayOptions) -> Gateway | None:
    """The replica's OpenAI gateway over the static and the registered workers, with the
    models' local tokenizers (None when disabled); TokenizerConfigError for a tokenizer
    that cannot be loaded."""
    if not options.enabled:
        return None
    from kvstream.gateway.app import Gateway
    from kvstream.gateway.static import FleetDirectory, RegisteredDirectory, StaticDirectory
    from kvstream.gateway.tokenize import local_tokenizers

    directory = FleetDirectory(StaticDirectory(options.workers), RegisteredDirectory(replica.registry))
    return Gateway(replica, directory, options, local_tokenizers(options.models))


#: The first socket a supervisor passes (systemd's SD_LISTEN_FDS_START).
_LISTEN_FDS_START = 3


def inherited_socket() -> socket.socket | None:
    """The listening socket a supervisor passed to this process (systemd socket
    activation: ``LISTEN_FDS`` sockets from fd 3, ``LISTEN_PID`` naming this process), or
    None. The variables are taken out of the environment, as sd_listen_fds(3) does. A
    supervisor holds the socket while the router restarts, so a connection that comes
    meanwhile waits in its backlog and is served, instead of being refused."""
    fds, pid = os.environ.pop("LISTEN_FDS", None), os.environ.pop("LISTEN_PID", None)
    os.environ.pop("LISTEN_FDNAMES", None)
    if fds is None or pid != str(os.getpid()):  # none, or meant for another process
        return None
    if fds != "1":
        raise click.ClickException(f"LISTEN_FDS={fds}: kvstream router serves on exactly one passed socket")
    try:
        sock = socket.socket(fileno=_LISTEN_FDS_START)
    except OSError as exc:
        raise click.ClickException(f"LISTEN_FDS=1 but fd {_LISTEN_FDS_START} is not a socket: "
                                   f"{os.strerror(exc.errno or 0).lower()}") from None
    listening = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
    if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM or not listening:
        sock.detach()  # the supervisor's fd: not this process's to close
        raise click.ClickException(f"the socket passed on fd {_LISTEN_FDS_START} (LISTEN_FDS) is not a listening TCP socket")
    return sock


class _Server(uvicorn.Server):
    """uvicorn, saying where it serves once its sockets are bound (the port a ``--port 0``
    got; nothing when the port is taken: uvicorn says so and the command fails)."""

    replica_id = ""

    async def startup(self, sockets=None) -> None:  # type: ignore[no-untyped-def]
        await super().startup(sockets)
        if self.started:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            log.info("serving", replica=self.replica_id, host=host, port=port)


@click.command("router")
@click.option("--config", "config_file", type=click.Path(dir_okay=False), help="TOML settings file.")
@click.option("--bootstrap", help="Kafka bootstrap servers (default: the local broker).")
@click.option("--host", help=f"HTTP bind address [{_SERVER.host}]; not used with a socket passed by systemd (LISTEN_FDS).")
@click.option("--port", type=int, help=f"HTTP port [{_SERVER.port}]; not used with a socket passed by systemd (LISTEN_FDS).")
@click.option("--snapshot-dir", type=click.Path(file_okay=False, path_type=Path), help="Where snapshots live.")
@click.option("--peer", "peer_url", help="Base URL of a peer replica to bootstrap from.")
@click.option("--token", help="Bearer token for every scope (visible in ps: prefer --token-file or KVSTREAM_REPLICA__TOKEN).")
@click.option("--token-file", type=click.Path(dir_okay=False, path_type=Path), help="File holding the bearer token for every scope.")
@click.option("--allow-open-bind", is_flag=True, default=None, help="Bind a non-loopback address without any token.")
@click.option("--gateway/--no-gateway", default=None,
              help="Serve the OpenAI endpoints (/v1/completions, /v1/chat/completions, /v1/models, /v1/embeddings) "
              "for the workers of [[gateway.workers]] [gateway].")
def router(
    config_file: str | None,
    bootstrap: str | None,
    host: str | None,
    port: int | None,
    snapshot_dir: Path | None,
    peer_url: str | None,
    token: str | None,
    token_file: Path | None,
    allow_open_bind: bool | None,
    gateway: bool | None,
) -> None:
    """Run a router replica: fold kvstream.events, snapshot it, serve routing over HTTP.

    Tokens by scope (client, operator, peer), TLS and the HTTP limits are settings
    ([replica] in TOML, KVSTREAM_REPLICA__* in the environment); the OpenAI gateway's
    are [gateway] and its workers [[gateway.workers]] (KVSTREAM_GATEWAY__*); see
    docs/OPERATIONS.md and the README. Under systemd socket activation (LISTEN_FDS) it
    serves the socket systemd holds, which refuses no connection while it restarts."""
    try:
        settings = load_settings(config_file, bootstrap=bootstrap, **logging_flags())
    except SettingsError as exc:
        raise click.ClickException(str(exc)) from None
    configure_logging(settings.log_level, settings.log_format)
    flags = {
        "host": host, "port": port, "snapshot_dir": snapshot_dir, "peer_url": peer_url, "token": token,
        "token_file": token_file, "allow_open_bind": allow_open_bind,
    }
    try:
        settings.replica = ReplicaSettings.model_validate(
            settings.replica.model_dump() | {k: v for k, v in flags.items() if v is not None}
        )
        scoped_tokens = tokens(settings)
        options = replica_options(settings)
    except ValidationError as exc:
        raise click.ClickException(explain(exc, ("replica",))) from None
    except TokenError as exc:
        raise click.ClickException(str(exc)) from None
    r = settings.replica
    inherited = inherited_socket()
    host = inherited.getsockname()[0] if inherited is not None else r.host
    if scoped_tokens.open and not is_loopback(host) and not r.allow_open_bind:
        raise click.ClickException(
            f"refusing to serve {host} (not loopback) without a token: set KVSTREAM_REPLICA__TOKEN "
            "or token_file (or per scope: client_, operator_, peer_token), or --allow-open-bind"
        )
    limits = http_limits(settings)
    gave_up = threading.Event()

    def on_fatal(_reason: str) -> None:
        gave_up.set()
        os.kill(os.getpid(), signal.SIGTERM)  # stop serving; the exit status says why

    try:
        replica = Replica(settings, options, router_config(settings), on_fatal=on_fatal)
    except ReplicaError as exc:
        raise click.ClickException(f"cannot start the replica: {exc}") from None
    # Bound before the replica starts: a taken port is one line, not a replica that
    # recovers, says it is ready, and then fails.
    try:
        sock = inherited if inherited is not None else socket.create_server((r.host, r.port), family=socket.AF_INET6 if ":" in r.host else socket.AF_INET)
    except OSError as exc:
        raise click.ClickException(
            f"cannot serve on {r.host}:{r.port}: {os.strerror(exc.errno or 0).lower()} (is another process using the port? --port)"
        ) from None
    t0 = time.monotonic()
    try:
        replica.start()
    except Exception as exc:
        sock.close()
        raise click.ClickException(f"cannot start the replica: {exc}") from None
    t_replica = time.monotonic()
    # The replica catches up with the log in its threads (broker round trips, mostly
    # waiting) while this thread loads the tokenizers and the HTTP side (CPU): a restart
    # is ready when the slower of the two is done, not after both.
    gw_options = settings.gateway if gateway is None else replace(settings.gateway, enabled=gateway)
    try:
        gw = gateway_for(replica, gw_options)
    except GatewayError as exc:
        replica.stop()
        sock.close()
        raise click.ClickException(f"cannot start the gateway: {exc}") from None
    t_gateway = time.monotonic()
    from kvstream.replica.service import create_app

    app = create_app(replica, tokens=scoped_tokens, limits=limits, docs=r.http_docs, gateway=gw)
    server = _Server(
        server_config(app, settings, limits, lambda limit: replica.metrics.http_rejected.labels(limit=limit).inc())
    )
    server.replica_id = replica.replica_id
    # Where the start-up's time went, one line (issue 33: a restart answers once it is done).
    log.info("started", replica=replica.replica_id, replica_s=round(t_replica - t0, 3),
             gateway_s=round(t_gateway - t_replica, 3), app_s=round(time.monotonic() - t_gateway, 3),
             ready=replica.ready)
    signal.signal(signal.SIGTERM, lambda *_: setattr(server, "should_exit", True))
    # uvicorn handles Ctrl-C while it serves and raises it again once stopped: then this
    # command ends as every kvstream command does on Ctrl-C (130).
    interrupted = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: interrupted.set())
    freeze_heap()
    try:
        server.run(sockets=[sock])
    finally:
        replica.stop()
    if gave_up.is_set():
        raise click.ClickException(f"the replica gave up: {replica.fatal}")
    if interrupted.is_set():
        raise KeyboardInterrupt
