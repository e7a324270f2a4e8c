"""``replay diff A B``: what one index state holds that the other does not, per worker,
rank and tier.

A side is a snapshot directory (``DIR``, or ``DIR@GEN`` for one generation), a live
replica (``http://host:port``: its ``GET /v1/workers`` view), or a time (anything
``parse_time`` reads: the index rebuilt as of then). Snapshots and rebuilt states know
every block, so they are compared block by block; a live view only knows how many
blocks each worker holds, so against one the counts are compared.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kvstream.events.model import Tier
from kvstream.replica.errors import SnapshotError
from kvstream.replica.fold import LogFold
from kvstream.replica.snapshot import unpack_worker
from kvstream.router.index import WorkerBlocks
from kvstream.settings import Settings
from kvstream.tools.replay.errors import ReplayError, SourceError
from kvstream.tools.replay.reader import format_time, parse_time
from kvstream.tools.replay.rebuild import open_store, rebuild_at

#: (worker id, dp rank, tier value)
Key = tuple[int, int, str]
#: A block: (block hash, sequence hash). Same block hash at another position differs.
Block = tuple[int, int]


@dataclass(frozen=True, slots=True)
class IndexState:
    label: str
    counts: dict[Key, int]
    #: None when the source knows only counts (a live replica's view).
    blocks: dict[Key, frozenset[Block]] | None


@dataclass(frozen=True, slots=True)
class Difference:
    key: Key
    count_a: int
    count_b: int
    #: Block hashes in A and not in B, and the reverse (empty when comparing counts).
    only_a: tuple[int, ...] = ()
    only_b: tuple[int, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        wid, rank, tier = self.key
        return {
            "worker_id": wid, "dp_rank": rank, "tier": tier,
            "count_a": self.count_a, "count_b": self.count_b,
            "only_a": list(self.only_a), "only_b": list(self.only_b),
        }


def _from_parts(label: str, parts: dict[int, list[WorkerBlocks]]) -> IndexState:
    blocks: dict[Key, frozenset[Block]] = {}
    for wid, wparts in parts.items():
        for p in wparts:
            if len(p.block_hashes):  # an empty part only keeps a rank known
                blocks[(wid, p.dp_rank, p.tier.value)] = frozenset(zip(p.block_hashes, p.seq_hashes))
    return IndexState(label, {k: len(v) for k, v in blocks.items()}, blocks)


def state_of_fold(fold: LogFold, label: str) -> IndexState:
    router = fold.router
    wids = {k.worker_id for k in router.workers()}
    return _from_parts(label, {w: router.export_worker(w) for w in wids})


def state_of_snapshot(path: Path, gen: int | None) -> IndexState:
    store = open_store(path)
    try:
        try:
            if gen is None:
                loaded, skipped = store.load_latest()
                if loaded is None:
                    raise SourceError(
                        f"no readable snapshot in {path}" + (f": {'; '.join(skipped)}" if skipped else "")
                    )
            else:
                loaded = store.load(gen)
            meta, blobs = loaded
            parts = {w: unpack_worker(b) for w, b in blobs.items()}
        except SnapshotError as exc:
            raise SourceError(f"snapshot {path}: {exc}") from None
    finally:
        store.close()
    return _from_parts(f"snapshot {path} generation {meta.gen}", parts)


def state_of_replica(url: str, token: str | None) -> IndexState:
    headers = {"authorization": f"Bearer {token}"} if token else {}
    try:
        resp = httpx.get(url.rstrip("/") + "/v1/workers", headers=headers, timeout=30)
    except httpx.HTTPError as exc:
        raise SourceError(f"cannot reach replica {url}: {exc}") from None
    if resp.status_code != 200:
        raise SourceError(f"replica {url} answered {resp.status_code}: {resp.text[:200]}")
    try:
        workers = resp.json()["workers"]
        counts = {
            (int(w), int(r), Tier(t).value): int(n)
            for w, doc in workers.items()
            for r, tiers in doc["ranks"].items()
            for t, n in tiers.items()
            if n
        }
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise SourceError(f"replica {url}: unexpected /v1/workers answer ({exc})") from None
    return IndexState(f"replica {url}", counts, None)


def resolve(
    spec: str,
    settings: Settings,
    snapshot_dir: Path | None,
    token: str | None,
    progress: bool | None,
) -> IndexState:
    """A side of the diff from its spec (see the module's docstring)."""
    if spec.startswith(("http://", "https://")):
        return state_of_replica(spec, token)
    path, sep, gen = spec.rpartition("@")
    if not sep or not path:  # no generation given ("@<ms>" is a time)
        path, gen = spec, ""
    if Path(path).is_dir():
        if gen and not gen.isdigit():
            raise SourceError(f"{spec}: the generation after @ must be a number")
        return state_of_snapshot(Path(path), int(gen) if gen else None)
    try:
        at_ms = parse_time(spec)
    except ReplayError:
        raise SourceError(
            f"{spec!r} is neither a snapshot directory, a replica URL (http://…) nor a time"
        ) from None
    rebuilt = rebuild_at(settings, at_ms, snapshot_dir, progress=progress)
    return state_of_fold(rebuilt.fold, f"log as of {format_time(at_ms)}")


def diff_states(a: IndexState, b: IndexState) -> list[Difference]:
    """Every (worker, rank, tier) whose blocks differ, sorted."""
    out = []
    for key in sorted(a.counts.keys() | b.counts.keys()):
        ca, cb = a.counts.get(key, 0), b.counts.get(key, 0)
        if a.blocks is not None and b.blocks is not None:
            sa, sb = a.blocks.get(key, frozenset()), b.blocks.get(key, frozenset())
            if sa != sb:
                out.append(
                    Difference(
                        key, ca, cb,
                        tuple(sorted({h for h, _ in sa - sb})),
                        tuple(sorted({h for h, _ in sb - sa})),
                    )
                )
        elif ca != cb:
            out.append(Difference(key, ca, cb))
    return out
