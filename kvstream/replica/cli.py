"""``kvstream router``: run one router replica (consume, snapshot, serve HTTP)."""

from __future__ import annotations

import os
import signal
import threading
from dataclasses import fields
from pathlib import Path

import click
import uvicorn

from kvstream.logs import get_logger
from kvstream.replica.replica import Replica, ReplicaOptions
from kvstream.router import RouterConfig, SchedulerConfig
from kvstream.settings import Settings, SettingsError, load_settings

log = get_logger(__name__)


def _pick(cls: type, values: dict) -> dict:
    """The entries of ``values`` that are fields of the dataclass ``cls``."""
    return {f.name: values[f.name] for f in fields(cls) if f.name in values}


def router_config(settings: Settings) -> RouterConfig:
    r = settings.router.model_dump()
    return RouterConfig(
        block_size=r["block_size"],
        scheduler=SchedulerConfig(**_pick(SchedulerConfig, r)),
        request_ttl_s=r["request_ttl_s"],
    )


def replica_options(settings: Settings) -> ReplicaOptions:
    r = settings.replica.model_dump()
    # Replicas of one deployment share the token, so a peer's is this one's.
    return ReplicaOptions(**_pick(ReplicaOptions, r), peer_token=r["token"])


@click.command("router")
@click.option("--config", "config_file", type=click.Path(dir_okay=False), help="TOML settings file.")
@click.option("--bootstrap", help="Kafka bootstrap servers (default: the local broker).")
@click.option("--host", help="HTTP bind address [127.0.0.1].")
@click.option("--port", type=int, help="HTTP port [8470].")
@click.option("--snapshot-dir", type=click.Path(file_okay=False, path_type=Path), help="Where snapshots live.")
@click.option("--peer", "peer_url", help="Base URL of a peer replica to bootstrap from.")
@click.option("--token", help="Bearer token the HTTP API requires.")
def router(
    config_file: str | None,
    bootstrap: str | None,
    host: str | None,
    port: int | None,
    snapshot_dir: Path | None,
    peer_url: str | None,
    token: str | None,
) -> None:
    """Run a router replica: fold kvstream.events, snapshot it, serve routing over HTTP."""
    try:
        settings = load_settings(config_file, bootstrap=bootstrap)
    except SettingsError as exc:
        raise click.ClickException(str(exc)) from None
    flags = {"host": host, "port": port, "snapshot_dir": snapshot_dir, "peer_url": peer_url, "token": token}
    settings.replica = settings.replica.model_copy(update={k: v for k, v in flags.items() if v is not None})
    from kvstream.replica.service import create_app

    gave_up = threading.Event()

    def on_fatal(_reason: str) -> None:
        gave_up.set()
        os.kill(os.getpid(), signal.SIGTERM)  # stop serving; the exit status says why

    replica = Replica(settings, replica_options(settings), router_config(settings), on_fatal=on_fatal)
    try:
        replica.start()
    except Exception as exc:
        raise click.ClickException(f"cannot start the replica: {exc}") from None
    app = create_app(replica, settings.replica.token)
    server = uvicorn.Server(
        uvicorn.Config(app, host=settings.replica.host, port=settings.replica.port, log_level="warning")
    )
    signal.signal(signal.SIGTERM, lambda *_: setattr(server, "should_exit", True))
    log.info("serving", replica=replica.replica_id, host=settings.replica.host, port=settings.replica.port)
    try:
        server.run()
    finally:
        replica.stop()
    if gave_up.is_set():
        raise click.ClickException(f"the replica gave up: {replica.fatal}")
