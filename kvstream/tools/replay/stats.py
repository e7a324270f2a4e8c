"""``replay stats``: what a range of the events topic holds and what the fold made of it.

Rejections, gaps, duplicate ids and stale epochs depend on the state before the range
(a store is rejected when its parent is missing), so the replica's fold runs from the
start of each partition read and counts only the records inside the range; each
record's counter changes are charged to the worker whose batch it was.
"""

from __future__ import annotations

import heapq
from collections import Counter, defaultdict
from typing import Any

from kvstream.events.codec import EventCodec
from kvstream.events.model import EventBatch, Stored, Removed
from kvstream.replica.fold import EXPIRED
from kvstream.settings import Settings
from kvstream.tools.replay.dump import KIND_OF
from kvstream.tools.replay.reader import Bounds, LogReader, format_time
from kvstream.tools.replay.rebuild import new_fold


def collect_stats(
    settings: Settings, bounds: Bounds, *, top: int = 10, progress: bool | None = None
) -> dict[str, Any]:
    codec = EventCodec()
    last: list[EventBatch | None] = [None]

    def decode(value: bytes) -> EventBatch:
        # Keeps what the fold decoded, so each record is decoded once.
        last[0] = batch = codec.decode(value)
        return batch

    with LogReader(settings, "events") as reader:
        start, end = reader.resolve(bounds)
        begin = {p: reader.low[p] for p in start}
        notes = [
            f"partition {p}: offsets before {reader.low[p]} were deleted by retention; "
            "rejections may include stores whose parents were deleted"
            for p in start if reader.low[p] > 0 and start[p] < end[p]
        ]
        fold = new_fold(settings, (bounds.to_ms or 0) / 1000, decode)
        by_kind: Counter[str] = Counter()
        by_tier: Counter[str] = Counter()
        blocks: Counter[str] = Counter()
        per_worker: dict[int, Counter[str]] = defaultdict(Counter)
        rejections: Counter[str] = Counter()
        issues: dict[int, Counter[str]] = defaultdict(Counter)
        largest: list[tuple[int, int, int, int, int, int]] = []
        records = ticks = heartbeats = undecodable = 0
        first_ms: int | None = None
        last_ms: int | None = None
        for r in reader.read(begin, end, progress=progress, desc="stats"):
            if r.offset < start[r.partition]:
                fold.apply(r)
                continue
            records += 1
            first_ms = r.timestamp_ms if first_ms is None else min(first_ms, r.timestamp_ms)
            last_ms = r.timestamp_ms if last_ms is None else max(last_ms, r.timestamp_ms)
            last[0] = None
            before = Counter(fold.rejections())
            fold.apply(r)
            batch = last[0]
            delta = Counter(fold.rejections()) - before
            if delta:
                rejections.update(delta)
                if batch is not None:
                    # Expiries come from the partition's clock, not from this batch.
                    issues[batch.worker_id].update({k: v for k, v in delta.items() if k != EXPIRED})
            if r.is_tick:
                ticks += 1
                continue
            if batch is None:
                undecodable += 1
                continue
            if not batch.events:
                heartbeats += 1
            n_blocks = 0
            for ev in batch.events:
                kind = KIND_OF[type(ev)]
                by_kind[kind] += 1
                by_tier[ev.tier.value] += 1
                per_worker[batch.worker_id][f"{ev.tier.value}/{kind}"] += 1
                if isinstance(ev, Stored | Removed):
                    n_blocks += len(ev.block_hashes)
                    blocks[kind] += len(ev.block_hashes)
            item = (len(batch.events), n_blocks, r.timestamp_ms, r.partition, r.offset, batch.worker_id)
            if len(largest) < top:
                heapq.heappush(largest, item)
            elif top:
                heapq.heappushpop(largest, item)
    return {
        "partitions": {str(p): [start[p], end[p]] for p in sorted(start)},
        "first_time": format_time(first_ms) if first_ms is not None else None,
        "last_time": format_time(last_ms) if last_ms is not None else None,
        "records": records,
        "ticks": ticks,
        "heartbeats": heartbeats,
        "undecodable": undecodable,
        "events_by_kind": dict(sorted(by_kind.items())),
        "events_by_tier": dict(sorted(by_tier.items())),
        "blocks_by_kind": dict(sorted(blocks.items())),
        "events_by_worker": {str(w): dict(sorted(c.items())) for w, c in sorted(per_worker.items())},
        "rejections": dict(sorted(rejections.items())),
        "issues_by_worker": {str(w): dict(sorted(c.items())) for w, c in sorted(issues.items()) if c},
        "largest_batches": [
            {"events": e, "blocks": b, "time": format_time(t), "partition": p, "offset": o, "worker_id": w}
            for e, b, t, p, o, w in sorted(largest, reverse=True)
        ],
        "notes": notes,
    }
