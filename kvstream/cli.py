"""The ``kvstream`` command. Subcommands are imported on first use, so that ``kvstream
hash`` starts fast and a router host never imports torch."""

from __future__ import annotations

import importlib
import sys

import click

from kvstream.logs import DEFAULT_FORMAT, DEFAULT_LEVEL, FORMATS, LEVELS, configure_logging

#: name → ("module:attribute" of a click command, its one-line summary for --help: listing
#: the commands must not import them, or `kvstream --help` would load torch).
COMMANDS: dict[str, tuple[str, str]] = {
    "hash": ("kvstream.tools.hash_cmd:hash_cmd", "Print a prompt's block hashes as JSON."),
    "bench": ("kvstream.tools.bench_cmd:bench", "Benchmarks of the hot paths; each prints one JSON object."),
    "config": ("kvstream.tools.config_cmd:config", "Show the effective settings and where each came from."),
    "broker": ("kvstream.kafka.cli:broker", "The local development Kafka broker (KRaft)."),
    "topics": ("kvstream.kafka.cli:topics", "Create kvstream's topics with the right settings."),
    "demo": ("kvstream.tools.demo:demo", "Run the demo fleet end to end and print what happened."),
    "router": ("kvstream.serve:router", "Run a router replica: fold the log, snapshot, serve HTTP."),
    "snapshot": ("kvstream.replica.snapshot_cli:snapshot", "Look into a replica's snapshots."),
    "worker": ("kvstream.worker.cli:worker", "Run a worker: bridge a vLLM/SGLang engine or the tiered pool."),
    "replay": ("kvstream.tools.replay.cli:replay", "Debug from the log: dump, rebuild, explain, diff, stats."),
    "simulate": ("kvstream.tools.simulate.cli:simulate", "Replay a trace through simulated engines and policies."),
    "workload": ("kvstream.tools.simulate.shapes:workload", "Write a generated trace (agents, system prompts, documents)."),
    "emulate": ("kvstream.emulator.cli:emulate", "Run an emulated vLLM engine (API, scheduling, KV events)."),
}


class LazyGroup(click.Group):
    """A click group whose subcommands live in modules imported only when run. ``lazy``:
    name → "module:attribute", or ("module:attribute", summary) to list the command in
    --help without importing it."""

    def __init__(self, *args: object, lazy: dict[str, str] | dict[str, tuple[str, str]], **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.lazy = {k: v if isinstance(v, tuple) else (v, None) for k, v in lazy.items()}

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(self.lazy))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in self.lazy:
            module, attr = self.lazy[cmd_name][0].split(":")
            try:
                return getattr(importlib.import_module(module), attr)
            except ModuleNotFoundError as exc:
                # An optional dependency (torch, on router hosts and the router image) is
                # missing: `kvstream --help` still lists the command, running it says why.
                return _unavailable(cmd_name, exc)
        return super().get_command(ctx, cmd_name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = []
        for name in self.list_commands(ctx):
            summary = self.lazy.get(name, (None, None))[1]
            if summary is None:
                cmd = self.get_command(ctx, name)
                if cmd is None or cmd.hidden:
                    continue
                summary = cmd.get_short_help_str(formatter.width - 6 - len(name))
            rows.append((name, summary))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


def _unavailable(name: str, exc: ModuleNotFoundError) -> click.Command:
    reason = f"kvstream {name} needs the Python package {exc.name!r}, which is not installed"

    def fail(**_: object) -> None:
        raise click.ClickException(reason)

    return click.Command(
        name, callback=fail, help=f"(unavailable: {reason})", context_settings={"ignore_unknown_options": True},
        params=[click.Argument(["args"], nargs=-1, type=click.UNPROCESSED)],
    )


@click.group(cls=LazyGroup, lazy=COMMANDS, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--log-level", envvar="KVSTREAM_LOG_LEVEL", type=click.Choice(LEVELS, case_sensitive=False),
              help=f"[settings: log_level, default {DEFAULT_LEVEL}]")
@click.option("--log-format", envvar="KVSTREAM_LOG_FORMAT", type=click.Choice(FORMATS),
              help=f"[settings: log_format, default {DEFAULT_FORMAT}]")
@click.version_option(package_name="kvstream")
def cli(log_level: str | None, log_format: str | None) -> None:
    """kvstream: KV-cache-aware routing for LLM inference fleets, event-sourced on Kafka."""
    # A command that reads the settings configures it again with their log_level and
    # log_format (TOML included; these flags still win): kvstream.logs.logging_flags.
    configure_logging(level=log_level or DEFAULT_LEVEL, fmt=log_format or DEFAULT_FORMAT)


def main() -> None:
    # Not click's standalone mode: it turns Ctrl-C into "Aborted!" and exit 1, where
    # kvstream's commands all end with 130 (the shell's convention for SIGINT).
    from kvstream.kafka.errors import KafkaSetupError

    try:
        status = cli.main(standalone_mode=False)
    except (KeyboardInterrupt, click.Abort):
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except KafkaSetupError as exc:  # e.g. kafka_options librdkafka refuses: one line, no traceback
        click.echo(f"Error: {exc}", err=True)
        sys.exit(1)
    except Exception as exc:
        kafka = sys.modules.get("confluent_kafka")
        if kafka is None or not isinstance(exc, kafka.KafkaException):
            raise
        # A client refused its configuration (SASL without credentials, an unknown
        # librdkafka key): one line, whichever command made the client.
        err = exc.args[0] if exc.args else exc
        text = err.str() if hasattr(err, "str") else str(err)
        click.echo(f"Error: Kafka client: {text} (see bootstrap and kafka_options in the settings)", err=True)
        sys.exit(1)
    sys.exit(status if isinstance(status, int) else 0)


if __name__ == "__main__":
    main()
