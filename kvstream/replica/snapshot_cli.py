"""``kvstream snapshot``: inspect and verify a replica's snapshot directory."""

from __future__ import annotations

import json
from pathlib import Path

import click

from kvstream.replica.errors import SnapshotError
from kvstream.replica.snapshot import SnapshotStore

_dir = click.argument("snapshot_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))


def _open(path: Path) -> SnapshotStore:
    try:
        return SnapshotStore(path, read_only=True)
    except SnapshotError as exc:
        raise click.ClickException(str(exc)) from None


@click.group("snapshot")
def snapshot() -> None:
    """Inspect or verify a replica's snapshots (RocksDB)."""


@snapshot.command("inspect")
@_dir
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def inspect(snapshot_dir: Path, as_json: bool) -> None:
    """Generations, offsets per partition, workers and blocks of the newest valid snapshot."""
    store = _open(snapshot_dir)
    try:
        loaded, skipped = store.load_latest()
        gens = store.candidates()[0]
    finally:
        store.close()
    if loaded is None:
        raise click.ClickException("no valid snapshot" + (f": {'; '.join(skipped)}" if skipped else ""))
    meta, _ = loaded
    doc = {
        "generation": meta.gen,
        "head": gens,
        "skipped": skipped,
        "topic": meta.topic,
        "topic_id": meta.topic_id,
        "partition_count": meta.partition_count,
        "created_ms": meta.created_ms,
        "next_offsets": meta.next_offsets(),
        "workers": sum(len(p.workers) for p in meta.partitions.values()),
        "blocks": meta.blocks(),
        "counters": meta.counters,
    }
    if as_json:
        click.echo(json.dumps(doc))
    else:
        for k, v in doc.items():
            click.echo(f"{k:<16} {v}")


@snapshot.command("verify")
@_dir
def verify(snapshot_dir: Path) -> None:
    """Check every checksum and stamp of the newest and the previous generation; exit 1,
    with the reason, if the newest is not intact (a replica would fall back)."""
    store = _open(snapshot_dir)
    try:
        gens, problems = store.candidates()
        for p in problems:
            click.echo(f"BROKEN: {p}")
        if not gens:
            raise click.ClickException(
                "the directory holds no committed snapshot" + (" that can be read" if problems else "")
            )
        bad = bool(problems)
        for gen in gens:
            try:
                meta, blobs = store.load(gen)
                click.echo(f"generation {gen}: ok ({len(blobs)} workers, {meta.blocks()} blocks)")
            except SnapshotError as exc:
                click.echo(f"generation {gen}: BROKEN: {exc}")
                bad = bad or gen == gens[0]
    finally:
        store.close()
    if bad:
        raise SystemExit(1)
