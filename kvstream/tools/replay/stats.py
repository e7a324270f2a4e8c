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

from kvstream.events.codec import PACKED_KINDS, PACKED_TIERS, EventCodec, PackedBatch, PackedRecord
from kvstream.events.model import Cleared
from kvstream.replica.fold import EXPIRED
from kvstream.settings import Settings
from kvstream.tools.replay.dump import KIND_OF
from kvstream.tools.replay.reader import Bounds, LogReader, format_time
from kvstream.tools.replay.rebuild import new_fold


class _KeepingReader:
    """The codec's reader, keeping the batch of the last record it read (so that each
    record is decoded once, by the fold)."""

    def __init__(self, codec: EventCodec) -> None:
        self._codec = codec
        self.last: PackedBatch | None = None

    def read_packed(self, data: bytes) -> PackedRecord:
        record = self._codec.read_packed(data)
        self.last = record[1]
        return record


def collect_stats(
    settings: Settings, bounds: Bounds, *, top: int = 10, progress: bool | None = None
) -> dict[str, Any]:
    kept = _KeepingReader(EventCodec())

    with LogReader(settings, "events") as reader:
        start, end = reader.resolve(bounds)
        begin = {p: reader.low[p] for p in start}
        notes = [
            f"partition {p}: offsets before {reader.low[p]} were deleted by retention; "
            "rejections may include stores whose parents were deleted"
            for p in start if reader.low[p] > 0 and start[p] < end[p]
        ]
        fold = new_fold(settings, (bounds.to_ms or 0) / 1000, kept)
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
            kept.last = None
            before = Counter(fold.rejections())
            fold.apply(r)
            batch = kept.last
            delta = Counter(fold.rejections()) - before
            if delta:
                rejections.update(delta)
                if batch is not None:
                    # Expiries come from the partition's clock, not from this batch.
                    issues[batch[0]].update({k: v for k, v in delta.items() if k != EXPIRED})
            if r.is_tick:
                ticks += 1
                continue
            if batch is None:
                undecodable += 1
                continue
            worker_id, _, _, events = batch
            if not events:
                heartbeats += 1
            n_blocks = 0
            for code, _, tier_code, _, _, _, _, n, _ in events:
                cls, tier = PACKED_KINDS[code], PACKED_TIERS[tier_code].value
                kind = KIND_OF[cls]
                by_kind[kind] += 1
                by_tier[tier] += 1
                per_worker[worker_id][f"{tier}/{kind}"] += 1
                if cls is not Cleared:
                    n_blocks += n
                    blocks[kind] += n
            item = (len(events), n_blocks, r.timestamp_ms, r.partition, r.offset, worker_id)
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
