"""``kvstream bench index``: tier-index apply throughput, match latency and memory.

Workload (seeded): ``--workers`` workers each hold conversations of a shared population
(``--families`` system prompts of 64 blocks, then unique tails) until ``--blocks`` block
identities are indexed in all. Most conversations sit on the device tier only; the others
are tiered as an offload engine leaves them: device holds the first part of the chain,
host_pinned a longer part, disk the whole of it (each lower tier's chain starts at the
root, as its stores need their parents on that tier). Stores are cut into events of
``--event-blocks`` blocks. Queries are 8k-token prompts (512 blocks): a held
conversation continued with fresh blocks, so that device, host and disk all match.

The baseline, measured in the same run, is the plain design: per tier a dict from
sequence hash to the set of workers holding it, and a block-by-block walk with set
intersections for matching.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Sequence
from dataclasses import dataclass

import click
import numpy as np

from kvstream.events.model import LOWER_TIERS, Removed, RouterEvent, Stored, Tier
from kvstream.hashing import sequence_hashes
from kvstream.router.index import TieredIndex, TierOverlap, WorkerKey
from bench.dynamo_peer import side_by_side
from bench.common import (
    dynamo_option,
    emit,
    json_option,
    percentiles_us,
    rss_bytes,
    time_calls,
)

SYSTEM_BLOCKS = 64


@dataclass(frozen=True)
class Workload:
    events: list[Stored]
    queries: list[tuple[list[int], list[int]]]  # (local, sequence) hashes
    blocks: int
    tier_blocks: dict[str, int]


def make_workload(
    n_blocks: int,
    n_workers: int,
    families: int,
    event_blocks: int,
    prompt_blocks: int,
    n_queries: int,
    seed: int,
) -> Workload:
    rng = np.random.default_rng(seed)

    def u64s(n: int) -> list[int]:
        return rng.integers(0, 2**64, n, dtype=np.uint64).tolist()

    systems = [u64s(SYSTEM_BLOCKS) for _ in range(families)]
    conversations: list[list[int]] = []  # local hashes
    events: list[Stored] = []
    tier_blocks = {t.value: 0 for t in (Tier.DEVICE, *LOWER_TIERS)}
    per_worker = n_blocks // n_workers
    rank = 0

    def store(worker: int, tier: Tier, local: list[int]) -> None:
        ids = u64s(len(local))  # the worker's opaque block identities
        parent = None
        for i in range(0, len(local), event_blocks):
            chunk = slice(i, i + event_blocks)
            events.append(
                Stored(worker, rank, tier, 0, len(events), parent, tuple(ids[chunk]), tuple(local[chunk]))
            )
            parent = ids[chunk][-1]
        tier_blocks[tier.value] += len(local)

    for worker in range(n_workers):
        budget = per_worker
        while budget > 0:
            # Reuse a conversation of another worker a third of the time (popular ones
            # live on several workers), else start a new one.
            if conversations and rng.random() < 1 / 3:
                local = conversations[int(rng.integers(len(conversations)))]
            else:
                tail = u64s(int(rng.integers(SYSTEM_BLOCKS, prompt_blocks - SYSTEM_BLOCKS)))
                local = systems[int(rng.integers(families))] + tail
                conversations.append(local)
            if rng.random() < 0.6 or len(local) > budget:
                local = local[:budget]
                store(worker, Tier.DEVICE, local)
                budget -= len(local)
                continue
            n = len(local)
            dev, host = sorted(int(x) for x in rng.integers(1, n, 2))
            store(worker, Tier.DEVICE, local[:dev])
            store(worker, Tier.HOST_PINNED, local[: max(host, dev + 1)])
            store(worker, Tier.DISK, local)
            budget -= dev + max(host, dev + 1) + n
    queries = []
    for _ in range(n_queries):
        local = conversations[int(rng.integers(len(conversations)))]
        local = (local + u64s(prompt_blocks))[:prompt_blocks]
        queries.append((local, sequence_hashes(local)))
    return Workload(events, queries, sum(tier_blocks.values()), tier_blocks)


class DictOfSetsIndex:
    """Baseline: per tier, sequence hash → set of workers; per worker, block → sequence
    hash. Matching walks the prompt block by block with set intersections."""

    def __init__(self) -> None:
        self.owners: dict[Tier, dict[int, set[WorkerKey]]] = {}
        self.blocks: dict[tuple[Tier, WorkerKey], dict[int, int]] = {}
        self.workers: set[WorkerKey] = set()

    def apply(self, ev: RouterEvent) -> None:
        key = WorkerKey(ev.worker_id, ev.dp_rank)
        self.workers.add(key)
        owners = self.owners.setdefault(ev.tier, {})
        blocks = self.blocks.setdefault((ev.tier, key), {})
        if isinstance(ev, Removed):
            for bh in ev.block_hashes:
                s = blocks.pop(bh, None)
                if s is not None:
                    owners[s].discard(key)
            return
        assert isinstance(ev, Stored)
        parent = None if ev.parent_hash is None else blocks.get(ev.parent_hash)
        if ev.parent_hash is not None and parent is None:
            return
        for bh, s in zip(ev.block_hashes, sequence_hashes(ev.tokens_hashes, parent)):
            blocks[bh] = s
            owners.setdefault(s, set()).add(key)

    def find_matches_by_tier(self, seqs: Sequence[int]) -> dict[WorkerKey, TierOverlap]:
        counts = {w: [0, 0, 0, 0] for w in self.workers}
        device = self.owners.get(Tier.DEVICE, {})
        live = set(self.workers)
        for i, s in enumerate(seqs):
            live &= device.get(s, set())
            if not live:
                break
            for w in live:
                counts[w][0] = i + 1
        for t, tier in enumerate(LOWER_TIERS, start=1):
            owners = self.owners.get(tier, {})
            for w, c in counts.items():
                pos = sum(c)
                while pos < len(seqs) and w in owners.get(seqs[pos], ()):
                    c[t] += 1
                    pos += 1
        return {w: TierOverlap(*c) for w, c in counts.items() if any(c)}


def _apply_rate(apply, events: Sequence[RouterEvent]) -> float:
    blocks = sum(len(e.block_hashes) for e in events)  # type: ignore[union-attr]
    gc.collect()
    gc.disable()  # a collection pass in the middle would time the collector
    try:
        t0 = time.perf_counter()
        for ev in events:
            apply(ev)
        return blocks / (time.perf_counter() - t0)
    finally:
        gc.enable()


@click.command("index")
@click.option("--blocks", "n_blocks", default=1_000_000, show_default=True, help="Block identities indexed over all tiers.")
@click.option("--workers", "n_workers", default=64, show_default=True)
@click.option("--families", default=32, show_default=True, help="Shared system prompts.")
@click.option("--event-blocks", default=32, show_default=True, help="Blocks per stored event.")
@click.option("--prompt-blocks", default=512, show_default=True, help="Blocks per query (512 = 8k tokens of 16).")
@click.option("--queries", "n_queries", default=2000, show_default=True)
@click.option("--seed", default=0, show_default=True)
@dynamo_option
@json_option
def index_bench(
    n_blocks: int,
    n_workers: int,
    families: int,
    event_blocks: int,
    prompt_blocks: int,
    n_queries: int,
    seed: int,
    with_dynamo: bool,
    as_json: bool,
) -> None:
    """Block events applied per second, find_matches_by_tier p50/p99 and bytes per
    indexed block, against a dict-of-sets baseline measured in the same run."""
    if prompt_blocks <= 2 * SYSTEM_BLOCKS:
        raise click.BadParameter(f"must exceed {2 * SYSTEM_BLOCKS}", param_hint="--prompt-blocks")
    w = make_workload(n_blocks, n_workers, families, event_blocks, prompt_blocks, n_queries, seed)

    # The first build: timed, and its RSS growth is the memory per block (later
    # builds would reuse pages freed by earlier ones).
    index = TieredIndex()
    gc.collect()
    rss_before = rss_bytes()
    apply_rate = _apply_rate(index.apply, w.events)
    gc.collect()
    rss = rss_bytes() - rss_before
    heap = index.heap_bytes()
    indexed = sum(sum(s.values()) for s in index.tree_sizes().values())
    base = DictOfSetsIndex()
    base_apply_rate = _apply_rate(base.apply, w.events)

    # Same answers, or the timings compare different work.
    for local, seqs in w.queries[:50]:
        if index.find_matches_by_tier(local, seqs) != base.find_matches_by_tier(seqs):
            raise click.ClickException("index and baseline disagree on a query")
    matched = [index.find_matches_by_tier(local, seqs) for local, seqs in w.queries]
    it = iter(w.queries)
    with_seq = time_calls(lambda: index.find_matches_by_tier(*next(it)), len(w.queries))
    it = iter(w.queries)
    local_only = time_calls(lambda: index.find_matches_by_tier(next(it)[0]), len(w.queries))
    n_base = max(20, len(w.queries) // 20)
    it = iter(w.queries)
    base_match = time_calls(lambda: base.find_matches_by_tier(next(it)[1]), n_base)

    # Churn: remove the blocks of one event in ten, then store them again.
    churn = w.events[::10]
    removes = [Removed(e.worker_id, e.dp_rank, e.tier, 0, 0, e.block_hashes) for e in churn]
    remove_rate = _apply_rate(index.apply, removes)
    restore_rate = _apply_rate(index.apply, churn)

    t0 = time.perf_counter()
    for worker in range(n_workers):
        index.remove_worker(worker)
    remove_worker_s = (time.perf_counter() - t0) / n_workers
    if index.tree_sizes():
        raise click.ClickException("workers left after removing all of them")

    peer = side_by_side(w.events, [local for local, _ in w.queries]) if with_dynamo else None

    p50, p99 = percentiles_us(local_only, 50, 99)
    seq_p50, seq_p99 = percentiles_us(with_seq, 50, 99)
    b50, b99 = percentiles_us(base_match, 50, 99)
    credited = [sum(sum(o) for o in m.values()) for m in matched]
    emit(
        {
            "bench": "index",
            "blocks": w.blocks,
            "tier_blocks": w.tier_blocks,
            "workers": n_workers,
            "event_blocks": event_blocks,
            "prompt_blocks": prompt_blocks,
            "queries": len(w.queries),
            "mean_matched_workers": round(float(np.mean([len(m) for m in matched])), 1),
            "mean_credited_blocks": round(float(np.mean(credited)), 1),
            "apply_blocks_per_s": round(apply_rate),
            "remove_blocks_per_s": round(remove_rate),
            "restore_blocks_per_s": round(restore_rate),
            # Given the sequence hashes with the local ones (the router's call: the
            # hashing kernel returns both in one pass).
            "match_p50_us": seq_p50,
            "match_p99_us": seq_p99,
            # Given the local hashes only (the index chains them as far as it walks).
            "match_local_only_p50_us": p50,
            "match_local_only_p99_us": p99,
            "remove_worker_ms": round(remove_worker_s * 1e3, 2),
            "bytes_per_block": round(rss / w.blocks, 1),
            "table_bytes_per_block": round(heap / w.blocks, 1),
            "indexed_blocks": indexed,
            "baseline": "dict-of-sets",
            "baseline_apply_blocks_per_s": round(base_apply_rate),
            "baseline_match_p50_us": b50,
            "baseline_match_p99_us": b99,
            "apply_speedup": round(apply_rate / base_apply_rate, 2),
            "match_p50_speedup": round(b50 / seq_p50, 2),
            **(peer or {}),
        },
        as_json,
    )
