"""Figures of a simulation run, and the comparison plot (matplotlib: the ``plot`` extra)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from kvstream.events.model import Tier
from kvstream.tools.plotting import pyplot
from kvstream.tools.simulate.reference import ReferenceHits
from kvstream.tools.simulate.runner import SimResult

_TIERS = ((Tier.DEVICE, "device"), (Tier.HOST_PINNED, "host"), (Tier.DISK, "disk"))


def _pct(values: np.ndarray, q: float) -> float:
    return round(float(np.percentile(values, q)) * 1000, 1)


def summarize(
    result: SimResult, window: int | None = None, references: Mapping[str, ReferenceHits] | None = None
) -> dict[str, Any]:
    """One flat dict of the run's figures (what ``--json`` prints per policy).

    Hit rates are shares of prompt blocks: ``hit_rate`` found on any tier of the chosen
    worker, ``hit_rate_<tier>`` per tier (device first, then the lower-tier
    continuation), ``router_hit_rate_<tier>`` what the router credited the chosen worker
    with (in dedup mode every tier looks like device to it). ``references``: reference
    hit rates of the same requests (``upper_bound``: one LRU cache of the fleet's total
    capacity), overall and, with ``window``, in ``windows`` of that many requests (in
    arrival order) beside the run's own.
    """
    reqs = result.requests
    o = result.options
    blocks = sum(r.blocks for r in reqs) or 1
    ttft = np.array([r.first_token_s - r.arrival_s for r in reqs])
    e2e = np.array([r.finish_s - r.arrival_s for r in reqs])
    start = min(r.arrival_s for r in reqs)
    makespan = max(r.finish_s for r in reqs) - start
    per_worker = Counter(r.worker for r in reqs)
    counts = [per_worker.get(w, 0) for w in range(o.workers)]
    busy = np.array(result.busy_s)
    out: dict[str, Any] = {
        "policy": o.policy,
        "mode": o.mode.value,
        "workers": o.workers,
        "seed": o.seed,
        "requests": len(reqs),
        "hit_rate": round(sum(sum(r.hits.values()) for r in reqs) / blocks, 4),
    }
    for tier, name in _TIERS:
        out[f"hit_rate_{name}"] = round(sum(r.hits[tier] for r in reqs) / blocks, 4)
    for tier, name in _TIERS:
        out[f"router_hit_rate_{name}"] = round(sum(r.predicted[tier] for r in reqs) / blocks, 4)
    out.update(
        ttft_p50_ms=_pct(ttft, 50),
        ttft_p90_ms=_pct(ttft, 90),
        ttft_p99_ms=_pct(ttft, 99),
        ttft_mean_ms=round(float(ttft.mean()) * 1000, 1),
        e2e_p50_ms=_pct(e2e, 50),
        e2e_p99_ms=_pct(e2e, 99),
        throughput_req_per_s=round(len(reqs) / makespan, 3) if makespan > 0 else None,
        throughput_output_tok_per_s=round(sum(r.output_length for r in reqs) / makespan, 1) if makespan > 0 else None,
        # max / mean over workers: 1.0 is perfectly even.
        load_imbalance_busy=round(float(busy.max() / busy.mean()), 3) if busy.mean() > 0 else None,
        load_imbalance_requests=round(max(counts) / (sum(counts) / len(counts)), 3),
        requests_per_worker=counts,
        simulated_s=round(makespan, 1),
        events=result.log.events,
        records=result.log.records,
        events_per_s=round(result.log.events / result.wall_s, 1),
        fold_counters=result.log.counters,
        replicas_agree=result.replicas_agree,
        wall_s=round(result.wall_s, 2),
    )
    references = references or {}
    for name, ref in references.items():
        out[name] = round(ref.rate(), 4)
    if window is not None:
        out["windows"] = windows(result, window, references)
    return out


def windows(result: SimResult, size: int, references: Mapping[str, ReferenceHits]) -> list[dict[str, Any]]:
    """Hit rates per ``size`` requests in arrival order (the routing order)."""
    by_id = {r.request_id: r for r in result.requests}
    ordered = [by_id[rid] for rid, _ in result.decisions]
    out = []
    for start in range(0, len(ordered), size):
        part = ordered[start : start + size]
        blocks = sum(r.blocks for r in part) or 1
        row: dict[str, Any] = {
            "requests": [start, start + len(part)],
            "hit_rate": round(sum(sum(r.hits.values()) for r in part) / blocks, 4),
        }
        for name, ref in references.items():
            row[name] = round(ref.rate(start, start + len(part)), 4)
        out.append(row)
    return out


def plot(results: list[SimResult], path: str | Path) -> None:
    """TTFT CDFs (left) and hit rates per tier (right), one series per run."""
    plt = pyplot()

    fig, (ax_cdf, ax_hit) = plt.subplots(1, 2, figsize=(13, 5))
    labels = [_label(r) for r in results]
    for r, label in zip(results, labels):
        ttft = np.sort([(q.first_token_s - q.arrival_s) * 1000 for q in r.requests])
        ax_cdf.plot(ttft, np.arange(1, len(ttft) + 1) / len(ttft), label=label)
    ax_cdf.set_xscale("log")
    ax_cdf.set_xlabel("TTFT (ms, log scale)")
    ax_cdf.set_ylabel("fraction of requests")
    ax_cdf.set_title("Time to first token (CDF)")
    ax_cdf.grid(True, which="both", alpha=0.3)
    ax_cdf.legend()

    summaries = [summarize(r) for r in results]
    x = np.arange(len(results))
    bottom = np.zeros(len(results))
    for _, name in _TIERS:
        vals = np.array([s[f"hit_rate_{name}"] for s in summaries])
        ax_hit.bar(x, vals, bottom=bottom, label=name)
        bottom += vals
    for xi, total in zip(x, bottom):
        ax_hit.text(xi, total, f"{total:.1%}", ha="center", va="bottom")
    ax_hit.set_xticks(x, labels, rotation=15)
    ax_hit.set_ylabel("prompt blocks found in cache")
    ax_hit.set_title("Prefix hit rate by tier")
    ax_hit.set_ylim(0, max(0.05, float(bottom.max()) * 1.2))
    ax_hit.legend(title="tier")
    fig.suptitle(f"{results[0].options.workers} workers, {len(results[0].requests)} requests")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _label(result: SimResult) -> str:
    o = result.options
    return o.policy if o.policy != "kv" else f"kv ({o.mode.value})"
