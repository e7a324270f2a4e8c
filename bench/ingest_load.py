"""A paced ingest beside routing, for ``kvstream bench route --ingest-rate``: the route
latency a replica sees while it folds a given rate of block events into the same index.

The ingest is the replica's own path (kvstream/replica/replica.py ``_ingest_loop``): real
Avro ``EventBatch`` records, encoded beforehand with the project's codec, each decoded
and folded by :class:`~kvstream.replica.fold.LogFold` under the lock that routing takes
too, on its own thread. The records churn the routed workers' caches: each removes the
worker's previous fresh chain and stores a new one (so the index keeps its size and the
prompts' matches stay as they were). Records are due at the rate; the thread wakes every
millisecond and folds what is due as the replica folds the records one consume returned:
in slices of ``FOLD_SLICE`` records per hold of the lock (one hold per record made the
router wait on a thread wake-up per record under this shared machine's load; the whole
backlog in one hold stalls routing for as long as it takes). A thread that falls behind
folds more slices per tick (the rate reached says so).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvstream.events.codec import EventCodec
from kvstream.events.model import EventBatch, Removed, Stored, Tier
from kvstream.replica.fold import LogFold, fold_in_slices
from kvstream.router import Router

#: Blocks of each fresh chain (two stored events of 32, as an engine publishes them).
CHAIN_BLOCKS = 64
EVENT_BLOCKS = 32
#: Event ids of the churn start above any id of the workload (per-worker ids must rise).
FIRST_EVENT_ID = 1 << 40
#: How long the ingest thread sleeps when no record is due.
TICK_S = 0.001
MIN_ROUTING_S = 1.0


@dataclass(frozen=True, slots=True)
class IngestReport:
    #: Block events (stored + removed blocks) folded while routing ran, per second.
    events_per_s: float
    records: int
    #: Block events in records that the fold rejected in part (must be 0).
    rejected_records: int


def churn_records(workers: list[tuple[int, int]], n_records: int, seed: int) -> list[bytes]:
    """``n_records`` encoded batches, round-robin over ``workers`` ((worker_id, dp_rank),
    epoch 0 as the workload's): each removes the worker's chain of the previous round
    (none in the first) and stores a fresh one."""
    rng = np.random.default_rng(seed)
    codec = EventCodec()
    prev: dict[tuple[int, int], tuple[int, ...]] = {}
    next_id = dict.fromkeys(workers, FIRST_EVENT_ID)
    out = []
    for k in range(n_records):
        key = workers[k % len(workers)]
        wid, rank = key
        events: list[Stored | Removed] = []

        def eid() -> int:
            next_id[key] += 1
            return next_id[key]

        if key in prev:
            events.append(Removed(wid, rank, Tier.DEVICE, 0, eid(), prev[key]))
        ids = tuple(rng.integers(0, 2**64, CHAIN_BLOCKS, dtype=np.uint64).tolist())
        local = tuple(rng.integers(0, 2**64, CHAIN_BLOCKS, dtype=np.uint64).tolist())
        parent = None
        for i in range(0, CHAIN_BLOCKS, EVENT_BLOCKS):
            chunk = slice(i, i + EVENT_BLOCKS)
            events.append(Stored(wid, rank, Tier.DEVICE, 0, eid(), parent, ids[chunk], local[chunk]))
            parent = ids[chunk][-1]
        prev[key] = ids
        out.append(codec.encode(EventBatch(wid, 0, 3_600_000, tuple(events))))
    return out


def blocks_per_record(first: bool) -> int:
    return CHAIN_BLOCKS if first else 2 * CHAIN_BLOCKS


def route_under_ingest(
    router: Router,
    records: list[bytes],
    rate: float,
    workers: int,
    route_once: Callable[[], None],
    n_routes: int,
) -> tuple[list[int], IngestReport]:
    """Route ``n_routes`` times, and for at least ``MIN_ROUTING_S`` (each sample: wall
    ns of one ``route_once`` under the lock, waiting included), while a thread folds
    ``records`` at ``rate`` block events/s."""
    lock = threading.Lock()
    fold = LogFold(router, EventCodec())
    stop = threading.Event()
    done = [0, 0, 0]  # records, block events, records with a rejection

    def ingest() -> None:
        start = time.perf_counter()
        k = 0
        while k < len(records) and not stop.is_set():
            # The records due by now (at least one), folded as the replica folds what
            # one consume returned; then a tick's sleep.
            due = k
            blocks = done[1]
            now = time.perf_counter()
            while due < len(records) and blocks <= (now - start) * rate:
                blocks += blocks_per_record(due < workers)
                due += 1
            if due == k:
                time.sleep(TICK_S)
                continue
            outs: list = []
            fold_in_slices(
                lock,
                range(k, due),
                lambda js: outs.extend(fold.apply_record(0, j, int(time.time() * 1000), records[j]) for j in js),
            )
            # The first record of each worker has no ``cleared`` before it (the index
            # was built outside the fold): the fold notes that, and applies it.
            done[0] = due
            done[1] = blocks
            done[2] += sum(out.dlq_reason is not None for out in outs)
            k = due

    thread = threading.Thread(target=ingest, name="bench-ingest", daemon=True)
    samples = []
    clock = time.perf_counter_ns
    # Warm-up: the thread reaches its pace before timing starts.
    thread.start()
    time.sleep(0.2)
    base = (done[0], done[1], time.perf_counter())
    # At least a second of routing, so that the rate reached is one over many ticks.
    until = time.perf_counter() + MIN_ROUTING_S
    while len(samples) < n_routes or time.perf_counter() < until:
        t0 = clock()
        with lock:
            route_once()
        samples.append(clock() - t0)
        # A replica's routes come from its event loop, which gives up the GIL for I/O
        # between requests; a loop that never does would shut the ingest thread out.
        time.sleep(0)
    end = (done[0], done[1], time.perf_counter())
    stop.set()
    thread.join()
    if done[0] >= len(records):
        raise RuntimeError(
            f"the ingest ran out of records ({len(records)}) while routing: the rate reached is not measured"
        )
    return samples, IngestReport(round((end[1] - base[1]) / (end[2] - base[2])), end[0] - base[0], done[2])
