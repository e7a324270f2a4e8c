"""``kvstream broker`` (the local development Kafka) and ``kvstream topics``."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import click

from kvstream.kafka import local_broker
from kvstream.kafka.errors import KafkaSetupError
from kvstream.kafka.topics import TopicState, describe_topics, ensure_topics
from kvstream.settings import Settings, SettingsError, load_settings

_dir_option = click.option(
    "--dir",
    "cluster_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Folder of the cluster's data, logs and pid files [default: the kvstream cache].",
)


@click.group()
def broker() -> None:
    """The local development Kafka (KRaft, loopback only; ops/kafka/broker.sh)."""


#: What a restart of the local cluster costs, said by ``start`` and ``stop``.
_FRESH = (
    "every start is a fresh cluster: the log of the previous one in this folder is wiped and the "
    "port is new, so replicas and workers need the new bootstrap (and a replica's snapshots "
    "no longer match the log)"
)


@broker.command("start", help=f"Start the cluster and print its bootstrap servers; {_FRESH}.")
@click.option("--brokers", type=click.Choice(["1", "3"]), default="1", show_default=True)
@_dir_option
def broker_start(brokers: str, cluster_dir: Path | None) -> None:
    try:
        running = local_broker.local_bootstrap(cluster_dir)
        if running is not None:
            where = cluster_dir or local_broker.default_cluster_dir()
            click.echo(f"already running (its log kept), data in {where}", err=True)
            click.echo(running)
            return
        click.echo(
            f"starting {brokers} broker(s) with an empty log on new ports (the first start also downloads Kafka) ...",
            err=True,
        )
        t0 = time.monotonic()
        cluster = local_broker.start_local_cluster(int(brokers), cluster_dir)
    except KafkaSetupError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"started in {time.monotonic() - t0:.1f}s, data in {cluster.dir}", err=True)
    click.echo(cluster.bootstrap)


@broker.command("stop", help=f"Stop every broker of the cluster and wait until they are gone; {_FRESH}.")
@_dir_option
def broker_stop(cluster_dir: Path | None) -> None:
    try:
        local_broker.stop_local_cluster(cluster_dir)
    except KafkaSetupError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(
        "stopped; the next `kvstream broker start` wipes this cluster's log and serves on a new port", err=True
    )


@broker.command("status")
@_dir_option
def broker_status(cluster_dir: Path | None) -> None:
    """Show each broker; exit 1 unless all of them run."""
    try:
        status = local_broker.cluster_status(cluster_dir)
    except KafkaSetupError as exc:
        raise click.ClickException(str(exc)) from exc
    if not status.nodes:
        click.echo(f"no cluster in {cluster_dir or local_broker.default_cluster_dir()}")
        raise SystemExit(1)
    for index, pid in sorted(status.nodes.items()):
        click.echo(f"broker {index}: " + (f"running (pid {pid})" if pid else "stopped"))
    click.echo(f"bootstrap: {status.bootstrap}")
    if not status.running:
        raise SystemExit(1)


def _topic_options(f: Callable[..., None]) -> Callable[..., None]:
    f = click.option(
        "--config", "config_file", default=None, type=click.Path(dir_okay=False),
        help="TOML settings file [default: $KVSTREAM_CONFIG].",
    )(f)
    return click.option(
        "--bootstrap", default=None, help="Kafka bootstrap servers [default: settings]."
    )(f)


def _settings(config_file: str | None, bootstrap: str | None) -> Settings:
    try:
        return load_settings(config_file, bootstrap=bootstrap)
    except SettingsError as exc:
        raise click.ClickException(str(exc)) from exc


def _print_states(states: list[TopicState]) -> None:
    click.echo(f"{'topic':<32} {'state':<9} {'partitions':>10} {'rf':>3}  notes")
    for st in states:
        state = "created" if st.created else "exists" if st.exists else "MISSING"
        notes = []
        if st.partition_mismatch:
            notes.append(f"settings say {st.spec.partitions} partitions")
        notes += [f"{k}={actual} (settings: {want})" for k, (actual, want) in st.drift.items()]
        click.echo(
            f"{st.spec.name:<32} {state:<9} {st.partitions if st.exists else '-':>10} "
            f"{st.replication_factor if st.exists else '-':>3}  {'; '.join(notes)}"
        )


@click.group()
def topics() -> None:
    """kvstream's Kafka topics (DESIGN.md §2)."""


@topics.command("create")
@_topic_options
def topics_create(bootstrap: str | None, config_file: str | None) -> None:
    """Create the missing topics with kvstream's settings; verify the existing ones."""
    try:
        states = ensure_topics(_settings(config_file, bootstrap))
    except KafkaSetupError as exc:
        raise click.ClickException(str(exc)) from exc
    _print_states(states)


@topics.command("describe")
@_topic_options
def topics_describe(bootstrap: str | None, config_file: str | None) -> None:
    """Show the topics against the settings; exit 1 if one is missing or mis-partitioned."""
    try:
        states = describe_topics(_settings(config_file, bootstrap))
    except KafkaSetupError as exc:
        raise click.ClickException(str(exc)) from exc
    _print_states(states)
    if any(not st.exists or st.partition_mismatch for st in states):
        raise SystemExit(1)
