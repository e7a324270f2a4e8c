"""Load sweeps: every policy at several replay speeds, the figures against offered load
(the picture serving papers draw), and where each policy saturates."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstream.tools.plotting import pyplot
from kvstream.tools.simulate.errors import SimulationError
from kvstream.tools.simulate.reference import ReferenceHits
from kvstream.tools.simulate.runner import SimResult
from kvstream.tools.simulate.trace import Request, TraceOptions

#: Saturated: TTFT p50 above this multiple of the policy's p50 at the lowest load...
SATURATION_P50_FACTOR = 4.0
#: ...or the fleet still busy this long after the last arrival, as a share of the
#: arrival span (a backlog that the arrivals outpace).
SATURATION_BACKLOG = 0.10


@dataclass(frozen=True, slots=True)
class SweepPoint:
    speed: float
    #: Requests per second offered (arrivals over their span).
    offered: float
    result: SimResult


def parse_sweep(spec: str) -> list[float]:
    """``speed=1,2,4,8`` → [1, 2, 4, 8] (ascending, each > 0)."""
    key, sep, values = spec.partition("=")
    if key.strip() != "speed" or not sep:
        raise SimulationError(f"--sweep takes 'speed=A,B,...' (e.g. speed=1,2,4,8), got {spec!r}")
    try:
        speeds = [float(v) for v in values.split(",") if v.strip()]
    except ValueError:
        raise SimulationError(f"--sweep speeds must be numbers, got {values!r}") from None
    if not speeds or any(not v > 0 for v in speeds) or len(set(speeds)) != len(speeds):
        raise SimulationError(f"--sweep needs distinct speeds > 0, got {values!r}")
    return sorted(speeds)


def scaled(requests: Sequence[Request], speed: float) -> list[Request]:
    """The requests replayed ``speed`` times faster."""
    TraceOptions(speed=speed)  # validates it
    return [Request(r.request_id, r.arrival_ms / speed, r.input_length, r.output_length, r.hash_ids,
                    r.tokens_per_id) for r in requests]


def offered_rate(requests: Sequence[Request]) -> float:
    span_s = (requests[-1].arrival_ms - requests[0].arrival_ms) / 1000
    return len(requests) / span_s if span_s > 0 else float("inf")


def describe_window(requests: Sequence[Request], limit: int | None) -> str:
    span_min = (requests[-1].arrival_ms - requests[0].arrival_ms) / 60_000
    which = f"first {len(requests):,} requests" if limit is not None else f"all {len(requests):,} requests"
    return f"{which}, {span_min:.0f} min at speed 1"


def saturation(summaries: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Per policy: the lowest swept speed at which it is saturated (None: not within the
    sweep), and at the speed where round_robin saturates, each policy's TTFT p50/p99
    and round_robin's over the best (the ratio Dynamo's A/B reports)."""
    by_policy: dict[str, list[Mapping[str, Any]]] = {}
    for s in summaries:
        by_policy.setdefault(s["policy"], []).append(s)
    out: dict[str, Any] = {"criterion": (
        f"TTFT p50 > {SATURATION_P50_FACTOR:g}x its value at the lowest load, or still busy "
        f"{SATURATION_BACKLOG:.0%} of the arrival span after the last arrival")}
    first: dict[str, float | None] = {}
    for policy, rows in by_policy.items():
        rows = sorted(rows, key=lambda r: r["speed"])
        base = rows[0]["ttft_p50_ms"]
        first[policy] = next((r["speed"] for r in rows if _saturated(r, base)), None)
    out["saturation_speed"] = first
    rr = first.get("round_robin")
    if rr is not None:
        at = {s["policy"]: s for s in summaries if s["speed"] == rr}
        best = min((p for p in at if p != "round_robin"), key=lambda p: at[p]["ttft_p50_ms"], default=None)
        if best is not None:
            out["at_round_robin_saturation"] = {
                "speed": rr,
                "best_policy": best,
                "ttft_p50_ratio": round(at["round_robin"]["ttft_p50_ms"] / at[best]["ttft_p50_ms"], 2),
                "ttft_p99_ratio": round(at["round_robin"]["ttft_p99_ms"] / at[best]["ttft_p99_ms"], 2),
                "ttft_mean_ratio": round(at["round_robin"]["ttft_mean_ms"] / at[best]["ttft_mean_ms"], 2),
            }
    return out


def _saturated(row: Mapping[str, Any], base_p50: float) -> bool:
    span = row["requests"] / row["offered_req_per_s"]
    backlog = row["simulated_s"] - span
    return row["ttft_p50_ms"] > SATURATION_P50_FACTOR * base_p50 or backlog > SATURATION_BACKLOG * span


def saturation_markdown(table: Mapping[str, Any], summaries: Sequence[Mapping[str, Any]]) -> str:
    """The sweep as Markdown: figures per load and policy, then the saturation table."""
    lines = ["| speed | req/s | policy | hit rate | upper bound | TTFT p50 ms | p99 ms | mean ms |",
             "|---|---|---|---|---|---|---|---|"]
    for s in sorted(summaries, key=lambda r: (r["speed"], r["ttft_p50_ms"])):
        lines.append(f"| {s['speed']:g} | {s['offered_req_per_s']:.2f} | {s['policy']} | {s['hit_rate']:.1%} | "
                     f"{s.get('upper_bound', 0):.1%} | {s['ttft_p50_ms']:.0f} | {s['ttft_p99_ms']:.0f} | "
                     f"{s['ttft_mean_ms']:.0f} |")
    lines += ["", f"Saturation ({table['criterion']}):", "", "| policy | saturates at speed |", "|---|---|"]
    for policy, speed in table["saturation_speed"].items():
        lines.append(f"| {policy} | {'beyond the sweep' if speed is None else f'{speed:g}'} |")
    at = table.get("at_round_robin_saturation")
    if at is not None:
        lines += ["", f"At speed {at['speed']:g} (round_robin saturated): round_robin / {at['best_policy']} "
                  f"TTFT p50 {at['ttft_p50_ratio']}x, p99 {at['ttft_p99_ratio']}x, mean {at['ttft_mean_ratio']}x"]
    return "\n".join(lines)


#: One colour, marker and line style per policy, so that overlapping curves stay apart.
_STYLES = {
    "ttft": ("tab:green", "o"),
    "kv": ("tab:blue", "s"),
    "least_load": ("tab:orange", "^"),
    "round_robin": ("tab:red", "D"),
    "random": ("tab:gray", "v"),
}


def plot_sweep(points: Sequence[SweepPoint], references: Mapping[str, ReferenceHits], path: str | os.PathLike[str],
               title: str) -> None:
    """TTFT p50 and p99 (left, log scale) and hit rate (right) against offered load."""
    plt = pyplot()
    import numpy as np
    from matplotlib.ticker import PercentFormatter

    fig, (ax_t, ax_h) = plt.subplots(1, 2, figsize=(14, 5.5))
    policies = list(dict.fromkeys(p.result.options.policy for p in points))
    n = len(policies)
    for k, policy in enumerate(policies):
        color, marker = _STYLES.get(policy, (None, "x"))
        rows = sorted((p for p in points if p.result.options.policy == policy), key=lambda p: p.offered)
        # A small horizontal offset per policy keeps markers at the same load apart.
        x = np.array([p.offered for p in rows]) * (1 + 0.012 * (k - (n - 1) / 2))
        ttft = [np.array([(q.first_token_s - q.arrival_s) * 1000 for q in p.result.requests]) for p in rows]
        p50 = [float(np.percentile(t, 50)) for t in ttft]
        p99 = [float(np.percentile(t, 99)) for t in ttft]
        ax_t.plot(x, p50, color=color, marker=marker, linestyle="-", label=f"{policy} p50")
        ax_t.plot(x, p99, color=color, marker=marker, linestyle="--", fillstyle="none", label=f"{policy} p99")
        hits = [sum(sum(q.hits.values()) for q in p.result.requests) / max(1, sum(q.blocks for q in p.result.requests))
                for p in rows]
        ax_h.plot(x, hits, color=color, marker=marker, label=policy)
    xs = sorted({p.offered for p in points})
    for name, style in (("upper_bound", ":"), ("host_lru", "-.")):
        if name in references:
            rate = references[name].rate()
            ax_h.plot(xs, [rate] * len(xs), color="black", linestyle=style,
                      label=f"{name.replace('_', ' ')} (one LRU cache) {rate:.1%}")
    ax_t.set_xscale("log")
    ax_t.set_yscale("log")
    ax_t.set_xlabel("offered load (requests/s, log scale)")
    ax_t.set_ylabel("TTFT (ms, log scale)")
    ax_t.set_title("TTFT p50 (solid) and p99 (dashed) against load")
    ax_t.grid(True, which="both", alpha=0.3)
    ax_t.legend(fontsize=8, ncol=2)
    ax_h.set_xscale("log")
    ax_h.set_xlabel("offered load (requests/s, log scale)")
    ax_h.set_ylabel("prompt blocks found in cache")
    ax_h.set_title("Prefix hit rate against load")
    ax_h.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax_h.set_ylim(0, None)
    ax_h.grid(True, which="both", alpha=0.3)
    ax_h.legend(fontsize=8)
    workers = points[0].result.options.workers
    speeds = ", ".join(f"{s:g}" for s in sorted({p.speed for p in points}))
    fig.suptitle(f"{Path(title.split(':')[0]).name}{title[len(title.split(':')[0]):]} — {workers} workers, "
                 f"speeds {speeds}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
