"""The ``kvstream`` command. Subcommands are imported on first use, so that ``kvstream
hash`` starts fast and a router host never imports torch."""

from __future__ import annotations

import importlib
import sys

import click

from kvstream.logs import configure_logging

#: name → "module:attribute" of a click command; one line per subcommand.
COMMANDS: dict[str, str] = {
    "hash": "kvstream.tools.hash_cmd:hash_cmd",
    "bench": "kvstream.tools.bench:bench",
    "broker": "kvstream.kafka.cli:broker",
    "topics": "kvstream.kafka.cli:topics",
    "demo": "kvstream.tools.demo:demo",
    "router": "kvstream.replica.cli:router",
    "snapshot": "kvstream.replica.snapshot_cli:snapshot",
    "worker": "kvstream.worker.cli:worker",
    "replay": "kvstream.tools.replay.cli:replay",
    "simulate": "kvstream.tools.simulate.cli:simulate",
    "emulate": "kvstream.emulator.cli:emulate",
}


class LazyGroup(click.Group):
    """A click group whose subcommands live in modules imported only when run."""

    def __init__(self, *args: object, lazy: dict[str, str], **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.lazy = lazy

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(self.lazy))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in self.lazy:
            module, attr = self.lazy[cmd_name].split(":")
            try:
                return getattr(importlib.import_module(module), attr)
            except ModuleNotFoundError as exc:
                # An optional dependency (torch, on router hosts and the router image) is
                # missing: `kvstream --help` still lists the command, running it says why.
                return _unavailable(cmd_name, exc)
        return super().get_command(ctx, cmd_name)


def _unavailable(name: str, exc: ModuleNotFoundError) -> click.Command:
    reason = f"kvstream {name} needs the Python package {exc.name!r}, which is not installed"

    def fail(**_: object) -> None:
        raise click.ClickException(reason)

    return click.Command(
        name, callback=fail, help=f"(unavailable: {reason})", context_settings={"ignore_unknown_options": True},
        params=[click.Argument(["args"], nargs=-1, type=click.UNPROCESSED)],
    )


@click.group(cls=LazyGroup, lazy=COMMANDS, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--log-level", envvar="KVSTREAM_LOG_LEVEL", default="INFO", show_default=True)
@click.option(
    "--log-format",
    envvar="KVSTREAM_LOG_FORMAT",
    type=click.Choice(["console", "json"]),
    default="console",
    show_default=True,
)
@click.version_option(package_name="kvstream")
def cli(log_level: str, log_format: str) -> None:
    """kvstream: KV-cache-aware routing for LLM inference fleets, event-sourced on Kafka."""
    configure_logging(level=log_level, fmt=log_format)


def main() -> None:
    try:
        cli(standalone_mode=True)
    except KeyboardInterrupt:
        sys.exit(130)
