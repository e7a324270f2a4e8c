"""NVIDIA Dynamo's ``RadixTree`` (PyPI ``ai-dynamo-runtime``, the ``bench`` extra) side by
side with kvstream's index on the same workload, in the same process: ``--dynamo`` of
``kvstream bench index`` and ``kvstream bench route``.

Dynamo's tree holds one tier, so both sides index the workload's device-tier stores
only. Events reach Dynamo as its own serialized form (JSON ``KvCacheEvent`` bytes, built
before the clock starts); its apply runs on a background thread, so the timed apply ends
with a query, which waits behind the queued events. Matching is cold: each prompt is
matched once, by its local block hashes (what both take). Both run in a forked child, so
that their RSS growth is measured on fresh pages (not on pages the parent's own index
freed).
"""

from __future__ import annotations

import gc
import json
import multiprocessing as mp
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import click

from kvstream.events.model import Stored, Tier
from kvstream.hashing import sequence_hashes
from kvstream.router.index import TieredIndex
from bench.common import percentiles_us, rss_bytes, time_calls

try:
    from dynamo._core import RadixTree
except ImportError:  # the bench extra is not installed
    RadixTree = None

SKIPPED = "dynamo: skipped (ai-dynamo-runtime is not installed: pip install 'kvstream[bench]')"


def _content_addressed(events: Sequence[Stored]) -> list[Stored]:
    """The events with each block named by its position (its sequence hash), as an
    engine with prefix caching names a block it already holds: the workload gives a
    re-stored prefix fresh ids, which Dynamo's tree does not map (it then rejects the
    children's parent)."""
    seq_of: dict[tuple[int, int], int] = {}
    out = []
    for ev in events:
        parent = None if ev.parent_hash is None else seq_of[(ev.worker_id, ev.parent_hash)]
        seqs = sequence_hashes(ev.tokens_hashes, parent)
        for b, s in zip(ev.block_hashes, seqs):
            seq_of[(ev.worker_id, b)] = s
        out.append(replace(ev, parent_hash=parent, block_hashes=tuple(seqs)))
    return out


def _dynamo_event(ev: Stored) -> bytes:
    blocks = [{"block_hash": b, "tokens_hash": t} for b, t in zip(ev.block_hashes, ev.tokens_hashes)]
    data = {"stored": {"parent_hash": ev.parent_hash, "blocks": blocks}}
    return json.dumps({"event_id": ev.event_id, "data": data, "dp_rank": ev.dp_rank}).encode()


def side_by_side(events: Sequence[Stored], queries: Sequence[Sequence[int]]) -> dict[str, Any] | None:
    """kvstream's index and Dynamo's RadixTree on the device-tier ``events``; cold
    matching of ``queries`` (local hashes), in a forked child. None (after printing
    why) when Dynamo is absent."""
    if RadixTree is None:
        click.echo(SKIPPED, err=True)
        return None
    ctx = mp.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)

    def child() -> None:
        try:
            send.send(_compare(events, queries))
        except BaseException as exc:  # noqa: BLE001 (reported by the parent)
            send.send(f"{type(exc).__name__}: {exc}")

    proc = ctx.Process(target=child, daemon=True)
    proc.start()
    try:
        out = recv.recv()
    except EOFError:
        out = f"the comparison process died (exit code {proc.exitcode})"
    proc.join()
    if isinstance(out, str):
        raise click.ClickException(f"dynamo side-by-side failed: {out}")
    return out


def _compare(events: Sequence[Stored], queries: Sequence[Sequence[int]]) -> dict[str, Any]:
    assert RadixTree is not None
    device = _content_addressed([e for e in events if e.tier is Tier.DEVICE])
    blocks = sum(len(e.block_hashes) for e in device)
    payloads = [(e.worker_id, _dynamo_event(e)) for e in device]

    def build(apply: Any, items: Sequence[Any], flush: Any) -> tuple[float, int]:
        gc.collect()
        before = rss_bytes()
        gc.disable()
        try:
            t0 = time.perf_counter()
            for item in items:
                apply(*item)
            flush()
            rate = blocks / (time.perf_counter() - t0)
        finally:
            gc.enable()
        gc.collect()
        return rate, rss_bytes() - before

    ours = TieredIndex()
    our_rate, our_rss = build(lambda e: ours.apply(e), [(e,) for e in device], lambda: None)
    tree = RadixTree()
    probe = list(queries[0])
    their_rate, their_rss = build(tree.apply_event, payloads, lambda: tree.find_matches(probe))

    # Same answers on the device tier, or the timings compare different work.
    for q in queries[:20]:
        mine = {(k.worker_id, k.dp_rank): o.device for k, o in ours.find_matches_by_tier(q).items() if o.device}
        if mine != dict(tree.find_matches(list(q)).scores):
            raise click.ClickException("kvstream and Dynamo disagree on a device match")
    cold = list(queries[20:]) or list(queries)
    it = iter(cold)
    ours_match = time_calls(lambda: ours.find_matches_by_tier(next(it)), len(cold))
    it = iter(cold)
    theirs_match = time_calls(lambda: tree.find_matches(list(next(it))), len(cold))
    m50, m99 = percentiles_us(ours_match, 50, 99)
    d50, d99 = percentiles_us(theirs_match, 50, 99)
    return {
        "dynamo": "ai-dynamo-runtime RadixTree, device-tier stores, same process",
        "dynamo_device_blocks": blocks,
        "kvstream_device_apply_blocks_per_s": round(our_rate),
        "dynamo_apply_blocks_per_s": round(their_rate),
        "apply_ratio_vs_dynamo": round(our_rate / their_rate, 2),
        "kvstream_cold_match_p50_us": m50,
        "kvstream_cold_match_p99_us": m99,
        "dynamo_cold_match_p50_us": d50,
        "dynamo_cold_match_p99_us": d99,
        # Below 1: kvstream matches faster.
        "cold_match_p50_ratio_vs_dynamo": round(m50 / d50, 2),
        "kvstream_device_rss_bytes_per_block": round(our_rss / blocks, 1),
        "dynamo_rss_bytes_per_block": round(their_rss / blocks, 1),
    }
