"""Shared pieces of the benchmarks: timing, percentiles, output."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence

import click
import numpy as np

from kvstream.tools.output import emit

__all__ = ["best_of", "dynamo_option", "emit", "json_option", "percentiles_us", "rss_bytes", "time_calls"]

json_option = click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")


def percentiles_us(samples_ns: Sequence[int], *qs: float) -> list[float]:
    """Percentiles of nanosecond samples, in microseconds."""
    arr = np.asarray(samples_ns, dtype=np.float64) / 1e3
    return [round(float(np.percentile(arr, q)), 3) for q in qs]


def time_calls(fn: Callable[[], object], repeat: int) -> list[int]:
    """Wall time in ns of each of ``repeat`` calls of ``fn``."""
    out = []
    clock = time.perf_counter_ns
    for _ in range(repeat):
        t0 = clock()
        fn()
        out.append(clock() - t0)
    return out


def best_of(fn: Callable[[], object], loops: int, rounds: int = 5) -> float:
    """Best mean seconds per call over ``rounds`` rounds of ``loops`` calls (noise-robust)."""
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(loops):
            fn()
        best = min(best, (time.perf_counter() - t0) / loops)
    return best


def rss_bytes() -> int:
    """Resident set size (the compiled tables live outside Python's allocator, so
    tracemalloc would not see them)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


dynamo_option = click.option(
    "--dynamo", "with_dynamo", is_flag=True,
    help="Also run NVIDIA Dynamo's RadixTree on the same workload (ai-dynamo-runtime).",
)
