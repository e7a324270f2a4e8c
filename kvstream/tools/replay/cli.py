"""``kvstream replay``: dump, rebuild, explain, diff, stats (DESIGN.md §7, §9).

Exit codes: 0 done; 1 ``diff`` found differences; 2 the replay cannot be done (one
message on stderr saying why); 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click
from confluent_kafka import KafkaException

from kvstream.events.model import Tier
from kvstream.kafka.errors import KafkaConfigError
from kvstream.settings import Settings, SettingsError, load_settings
from kvstream.tools.replay.errors import ReplayError

if TYPE_CHECKING:
    from kvstream.tools.replay.reader import Bounds

F = TypeVar("F", bound=Callable[..., Any])


class ReplayFailed(click.ClickException):
    exit_code = 2


def _guard(fn: F) -> F:
    """Turn every expected failure into one message and an exit code, no traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (ReplayError, SettingsError, KafkaConfigError) as exc:
            raise ReplayFailed(str(exc)) from None
        except KafkaException as exc:
            raise ReplayFailed(f"Kafka: {exc.args[0]}") from None
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)

    return wrapper  # type: ignore[return-value]


def _settings(config_file: str | None, bootstrap: str | None, topic_prefix: str | None) -> Settings:
    settings = load_settings(config_file, bootstrap=bootstrap)
    if topic_prefix is not None:
        settings.topics = settings.topics.model_copy(update={"prefix": topic_prefix})
    return settings


def _common(fn: F) -> F:
    for opt in reversed(
        [
            click.option("--config", "config_file", type=click.Path(dir_okay=False), help="TOML settings file."),
            click.option("--bootstrap", help="Kafka bootstrap servers (default: the local broker)."),
            click.option("--topic-prefix", help="Topic name prefix [kvstream.]."),
            click.option(
                "--progress/--no-progress", default=None,
                help="Progress bar on stderr [shown when stderr is a terminal].",
            ),
        ]
    ):
        fn = opt(fn)
    return fn


def _range(fn: F) -> F:
    for opt in reversed(
        [
            click.option("--from", "from_", metavar="TIME", help="First record time (ISO 8601, @ms, now, -10m)."),
            click.option("--to", metavar="TIME", help="Last record time (inclusive)."),
            click.option("--from-offset", multiple=True, metavar="[P:]N", help="First offset (of partition P)."),
            click.option("--to-offset", multiple=True, metavar="[P:]N", help="Last offset (inclusive)."),
            click.option("--partition", type=int, multiple=True, help="Only these partitions."),
        ]
    ):
        fn = opt(fn)
    return fn


def _bounds(
    from_: str | None, to: str | None, from_offset: tuple[str, ...], to_offset: tuple[str, ...],
    partition: tuple[int, ...],
) -> Bounds:
    from kvstream.tools.replay.reader import Bounds, parse_offsets, parse_time

    return Bounds(
        from_ms=parse_time(from_) if from_ else None,
        to_ms=parse_time(to) if to else None,
        from_offsets=parse_offsets(from_offset),
        to_offsets=parse_offsets(to_offset),
        partitions=frozenset(partition) if partition else None,
    )


def _echo_json(doc: Any, indent: int | None = None) -> None:
    click.echo(json.dumps(doc, indent=indent))


def _notes(notes: list[str]) -> None:
    for n in notes:
        click.echo(f"note: {n}", err=True)


@click.group("replay")
def replay() -> None:
    """Replay the log to see what the routers knew, and why they decided as they did."""


# -- dump ------------------------------------------------------------------------------


@replay.command("dump")
@_common
@_range
@click.option("--worker", type=int, multiple=True, help="Only these workers.")
@click.option("--rank", type=int, multiple=True, help="Only these dp ranks.")
@click.option("--tier", type=click.Choice([t.value for t in Tier]), multiple=True, help="Only these tiers.")
@click.option(
    "--kind",
    type=click.Choice(["stored", "removed", "cleared", "heartbeat", "tick", "undecodable"]),
    multiple=True,
    help="Only these kinds.",
)
@click.option("--block-hash", type=int, help="Only events naming this block, tokens or parent hash.")
@click.option(
    "--jsonl", is_flag=True,
    help="One JSON object per event (for tools); ids and hashes (64-bit) as decimal strings.",
)
@click.option(
    "--u64-numbers", is_flag=True,
    help="With --jsonl: 64-bit ids and hashes as JSON numbers (tools that read numbers as doubles round them above 2^53).",
)
@click.option("--follow", is_flag=True, help="Keep printing new events until Ctrl-C (--from now: no history).")
@_guard
def dump(
    config_file: str | None, bootstrap: str | None, topic_prefix: str | None, progress: bool | None,
    from_: str | None, to: str | None, from_offset: tuple[str, ...], to_offset: tuple[str, ...],
    partition: tuple[int, ...], worker: tuple[int, ...], rank: tuple[int, ...], tier: tuple[str, ...],
    kind: tuple[str, ...], block_hash: int | None, jsonl: bool, u64_numbers: bool, follow: bool,
) -> None:
    """Events of a range of kvstream.events, filtered; a table, or JSON lines."""
    from kvstream.tools.replay.dump import TABLE_HEADER, EventFilter, dump_rows, json_row, table_line
    from kvstream.tools.replay.reader import LogReader

    if follow and (to or to_offset):
        raise ReplayError("--follow reads to the end and beyond: it takes no --to/--to-offset")
    if u64_numbers and not jsonl:
        raise ReplayError("--u64-numbers only applies to --jsonl")
    settings = _settings(config_file, bootstrap, topic_prefix)
    bounds = _bounds(from_, to, from_offset, to_offset, partition)
    filt = EventFilter(
        workers=frozenset(worker) or None,
        ranks=frozenset(rank) or None,
        tiers=frozenset(Tier(t) for t in tier) or None,
        kinds=frozenset(kind) or None,
        block_hash=block_hash,
    )
    with LogReader(settings, "events") as reader:
        start, end = reader.resolve(bounds)
        if not jsonl:
            click.echo(TABLE_HEADER)
        records = reader.read(start, None if follow else end, progress=progress and not follow, desc="dump")
        for row in dump_rows(records, filt):
            click.echo(json.dumps(json_row(row, u64_numbers)) if jsonl else table_line(row))


# -- rebuild ---------------------------------------------------------------------------


@replay.command("rebuild")
@_common
@click.option("--at", "at", required=True, metavar="TIME", help="The time to rebuild the index as of.")
@click.option(
    "--snapshot-dir", type=click.Path(path_type=Path),
    help="Start from the newest snapshot here taken before TIME (else from the start).",
)
@click.option(
    "--write-snapshot", type=click.Path(path_type=Path),
    help="Also write the state as a snapshot into this new directory.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@_guard
def rebuild(
    config_file: str | None, bootstrap: str | None, topic_prefix: str | None, progress: bool | None,
    at: str, snapshot_dir: Path | None, write_snapshot: Path | None, as_json: bool,
) -> None:
    """The index exactly as a replica held it at TIME, per worker and tier."""
    from kvstream.tools.replay.reader import format_time, parse_time
    from kvstream.tools.replay.rebuild import rebuild_at, summary
    from kvstream.tools.replay.rebuild import write_snapshot as write

    settings = _settings(config_file, bootstrap, topic_prefix)
    rebuilt = rebuild_at(settings, parse_time(at), snapshot_dir, progress=progress)
    _notes(rebuilt.notes)
    gen = write(rebuilt, write_snapshot) if write_snapshot is not None else None
    rows = summary(rebuilt.fold)
    counters = rebuilt.fold.rejections()
    doc = {
        "at": format_time(rebuilt.at_ms),
        "source": rebuilt.source,
        "records": rebuilt.records,
        "next_offsets": {str(p): o for p, o in sorted(rebuilt.end_offsets.items())},
        "workers": rows,
        "counters": {k: v for k, v in sorted(counters.items()) if v},
        "snapshot_generation": gen,
    }
    if as_json:
        _echo_json(doc)
        return
    click.echo(f"index as of {doc['at']} (from {rebuilt.source}, {rebuilt.records} records folded)")
    tiers = [t.value for t in Tier]
    click.echo(f"{'worker':>20} {'rank':>4} " + " ".join(f"{t:>11}" for t in tiers) + f" {'epoch':>5} {'part':>4}  last seen")
    for r in rows:
        click.echo(
            f"{r['worker_id']:>20} {r['dp_rank']:>4} " + " ".join(f"{r[t]:>11}" for t in tiers)
            + f" {r['epoch'] if r['epoch'] is not None else '-':>5} "
            f"{r['partition'] if r['partition'] is not None else '-':>4}  {r['last_seen'] or '-'}"
        )
    if doc["counters"]:
        click.echo("counters: " + ", ".join(f"{k}={v}" for k, v in doc["counters"].items()))
    if gen is not None:
        click.echo(f"snapshot generation {gen} written to {write_snapshot}")


# -- explain ---------------------------------------------------------------------------


@replay.command("explain")
@_common
@click.option("--at", "at", metavar="TIME", help="Route the prompt as of this time.")
@click.option(
    "--tokens-file", type=click.Path(dir_okay=False, path_type=Path),
    help="The prompt: a /v1/route JSON body, a JSON array of token ids, or ids separated by spaces.",
)
@click.option("--request-id", help="Explain this logged request, at the time it was routed.")
@click.option("--snapshot-dir", type=click.Path(path_type=Path), help="Rebuild the index from a snapshot here.")
@click.option("--table", "as_table", is_flag=True, help="A table for people instead of the API's JSON.")
@_guard
def explain(
    config_file: str | None, bootstrap: str | None, topic_prefix: str | None, progress: bool | None,
    at: str | None, tokens_file: Path | None, request_id: str | None, snapshot_dir: Path | None,
    as_table: bool,
) -> None:
    """Every candidate's tier matches, load and worker_logit terms, and the winner, as the
    router computed them at that time; the JSON of POST /v1/route with explain."""
    from kvstream.tools.replay.explain import explain_at, explain_request, load_request, table
    from kvstream.tools.replay.reader import parse_time

    if request_id is not None:
        if at or tokens_file:
            raise ReplayError("--request-id takes its time and prompt from the log: no --at/--tokens-file")
        settings = _settings(config_file, bootstrap, topic_prefix)
        out = explain_request(settings, request_id, snapshot_dir, progress=progress)
    else:
        if not (at and tokens_file):
            raise ReplayError("give --at TIME and --tokens-file FILE, or --request-id ID")
        settings = _settings(config_file, bootstrap, topic_prefix)
        out = explain_at(settings, parse_time(at), load_request(tokens_file), snapshot_dir, progress=progress)
    _notes(out.notes)
    if as_table:
        for line in table(out.decision):
            click.echo(line)
    else:
        _echo_json(out.decision)


# -- diff ------------------------------------------------------------------------------


@replay.command("diff")
@_common
@click.argument("a")
@click.argument("b")
@click.option(
    "--snapshot-dir", type=click.Path(path_type=Path),
    help="For a side given as a time: rebuild from a snapshot here.",
)
@click.option("--token", help="Bearer token of the replicas' HTTP API.")
@click.option("--show", type=int, default=5, show_default=True, help="Block hashes shown per line.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@_guard
def diff(
    config_file: str | None, bootstrap: str | None, topic_prefix: str | None, progress: bool | None,
    a: str, b: str, snapshot_dir: Path | None, token: str | None, show: int, as_json: bool,
) -> None:
    """Blocks in one index state and not the other, per worker, rank and tier. A and B:
    a snapshot directory (DIR or DIR@GEN), a replica URL (its /v1/workers), or a time.
    Exit 0 when equal, 1 when they differ."""
    from kvstream.tools.replay.diff import diff_states, resolve

    settings = _settings(config_file, bootstrap, topic_prefix)
    sa = resolve(a, settings, snapshot_dir, token, progress)
    sb = resolve(b, settings, snapshot_dir, token, progress)
    diffs = diff_states(sa, sb)
    if as_json:
        _echo_json({"a": sa.label, "b": sb.label, "equal": not diffs, "differences": [d.as_dict() for d in diffs]})
    else:
        click.echo(f"A: {sa.label}\nB: {sb.label}")
        if sa.blocks is None or sb.blocks is None:
            click.echo("(a live replica's view has counts only: comparing block counts)")
        for d in diffs:
            wid, rank, tier = d.key
            line = f"worker {wid} rank {rank} {tier}: A {d.count_a} blocks, B {d.count_b}"
            for name, hashes in (("only in A", d.only_a), ("only in B", d.only_b)):
                if hashes:
                    more = f" (+{len(hashes) - show} more)" if len(hashes) > show else ""
                    line += f"; {name}: {len(hashes)} [{', '.join(map(str, hashes[:show]))}{more}]"
            click.echo(line)
        click.echo("equal" if not diffs else f"{len(diffs)} (worker, rank, tier) differ")
    if diffs:
        sys.exit(1)


# -- stats -----------------------------------------------------------------------------


@replay.command("stats")
@_common
@_range
@click.option("--top", type=int, default=10, show_default=True, help="Largest batches listed.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@_guard
def stats(
    config_file: str | None, bootstrap: str | None, topic_prefix: str | None, progress: bool | None,
    from_: str | None, to: str | None, from_offset: tuple[str, ...], to_offset: tuple[str, ...],
    partition: tuple[int, ...], top: int, as_json: bool,
) -> None:
    """Events per worker, tier and kind, rejection reasons, gaps, duplicate ids and the
    largest batches over a range."""
    from kvstream.tools.replay.stats import collect_stats

    settings = _settings(config_file, bootstrap, topic_prefix)
    doc = collect_stats(settings, _bounds(from_, to, from_offset, to_offset, partition), top=top, progress=progress)
    _notes(doc["notes"])
    if as_json:
        _echo_json(doc)
        return
    click.echo(f"{doc['records']} records from {doc['first_time']} to {doc['last_time']} "
               f"({doc['ticks']} ticks, {doc['heartbeats']} heartbeats, {doc['undecodable']} undecodable)")
    for title, key in (("events by kind", "events_by_kind"), ("events by tier", "events_by_tier"),
                       ("blocks by kind", "blocks_by_kind"), ("rejections and skips", "rejections")):
        click.echo(f"{title}: " + (", ".join(f"{k}={v}" for k, v in doc[key].items()) or "none"))
    click.echo("events by worker (tier/kind):")
    for w, c in doc["events_by_worker"].items():
        click.echo(f"  {w:>20}  " + ", ".join(f"{k}={v}" for k, v in c.items()))
    if doc["issues_by_worker"]:
        click.echo("gaps, duplicates, stale epochs, rejections by worker:")
        for w, c in doc["issues_by_worker"].items():
            click.echo(f"  {w:>20}  " + ", ".join(f"{k}={v}" for k, v in c.items()))
    click.echo("largest batches:")
    for bt in doc["largest_batches"]:
        click.echo(f"  {bt['events']:>6} events {bt['blocks']:>7} blocks  worker {bt['worker_id']}  "
                   f"{bt['partition']}/{bt['offset']}  {bt['time']}")


# -- workers ---------------------------------------------------------------------------


@replay.command("workers")
@_common
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@_guard
def workers(
    config_file: str | None, bootstrap: str | None, topic_prefix: str | None, progress: bool | None, as_json: bool,
) -> None:
    """The worker registry as every replica folds it from kvstream.workers: each
    worker's engine URL, models, LoRA adapters, block size, ranks, role; and the records
    skipped, by reason."""
    from kvstream.replica.registry import WorkerRegistry
    from kvstream.tools.replay.reader import LogReader

    settings = _settings(config_file, bootstrap, topic_prefix)
    registry = WorkerRegistry()
    with LogReader(settings, "workers") as reader:
        for rec in reader.read(dict(reader.low), dict(reader.high), progress=progress, desc="workers"):
            registry.apply(rec.key, rec.value)
    doc = registry.view()
    if as_json:
        _echo_json(doc)
        return
    click.echo(f"{len(doc['workers'])} workers; {doc['applied']} records applied, skipped: "
               + (", ".join(f"{k}={v}" for k, v in doc["skipped"].items()) or "none"))
    for wid, reg in doc["workers"].items():
        loras = f" loras={','.join(reg['loras'])}" if reg["loras"] else ""
        handoff = f" handoff={reg['handoff']}" if reg["handoff"] else ""
        port = f" bootstrap_port={reg['bootstrap_port']}" if reg["bootstrap_port"] is not None else ""
        click.echo(f"  {wid:>20}  {reg['url'] or '(not routable: no engine URL)'}  models={','.join(reg['models'])}"
                   f"{loras}  {reg['engine']}  block_size={reg['block_size']}  ranks={reg['dp_ranks']}"
                   f"  role={reg['role']}{handoff}{port}")
