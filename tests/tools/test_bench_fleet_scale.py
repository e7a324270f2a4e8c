"""``kvstream bench fleet-scale`` (issue 35): its generator against the reference index,
and a small run against the real broker whose replica must hold what a reference fold of
the very same records holds."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from bench import bench
from bench.fleet_scale import FleetLoad, LoadSpec, ShardRecord, WorkerProfile, chain_shard, index_digest
from kvstream.events.codec import EventCodec
from kvstream.events.model import Removed, Stored
from kvstream.hashing import sequence_hashes

from tests.router.reference import ReferenceIndex

PROFILE = WorkerProfile(request_blocks=16, device_blocks=64, host_blocks=128, disk_blocks=256)


def reference_fold(records: list[ShardRecord], ref: ReferenceIndex, epochs: dict[int, int], shard: int = 0) -> int:
    """Fold the encoded records of ``shard`` into ``ref`` as a replica does (a new epoch
    wipes the worker, DESIGN.md §2); returns the events."""
    codec = EventCodec()
    n = 0
    for s, wid, value in records:
        if s != shard:
            continue
        batch = codec.decode(value)
        assert batch.worker_id == wid
        if epochs.get(wid) != batch.epoch:
            ref.remove_worker(wid)
            epochs[wid] = batch.epoch
        for ev in batch.events:
            ref.apply(ev)
        n += len(batch.events)
    return n


def held_by_worker_tier(ref: ReferenceIndex) -> dict[tuple[int, str], set[int]]:
    out: dict[tuple[int, str], set[int]] = {}
    for (tier, key), blocks in ref.blocks.items():
        if blocks:
            out.setdefault((key.worker_id, tier.value), set()).update(blocks)
    return out


def reference_digest(refs: list[ReferenceIndex]) -> str:
    held: dict[tuple[int, int, str], list[int]] = {}
    for ref in refs:
        for (t, k), b in ref.blocks.items():
            held.setdefault((k.worker_id, k.dp_rank, t.value), []).extend(b)
    return index_digest(held)


def spec(seconds: float, restarts_per_s: float, seed: int, shards: int = 1) -> LoadSpec:
    return LoadSpec("", ("",) * shards, 1, PROFILE, seconds, restarts_per_s, seed)


def test_streams_fold_to_what_the_workers_hold_at_the_rate_derived() -> None:
    load = FleetLoad(spec(2.0, 0.0, 3))
    ref, epochs = ReferenceIndex(), {}
    reference_fold(load.join(4), ref, epochs)
    # A joining worker publishes full tiers: its disk, and the newest chains on host and device.
    assert load.block_events == [4 * (256 + 128 + 64)]
    ticks, restarts = load.play()
    assert restarts == 0
    stored = removed = 0
    codec = EventCodec()
    for records in ticks:
        for _, _, value in records:
            for ev in codec.decode(value).events:
                stored += len(ev.block_hashes) if type(ev) is Stored else 0
                removed += len(ev.block_hashes) if type(ev) is Removed else 0
        reference_fold(records, ref, epochs)
    assert not +ref.counters  # nothing rejected: every parent on its tier, every remove known
    # Full tiers: every block stored is evicted too, on each of the three tiers.
    played = load.block_events[0] - 4 * (256 + 128 + 64)
    assert stored == removed == played // 2
    assert played == pytest.approx(4 * PROFILE.events_per_s * 2.0, rel=0.1)
    assert {k: len(v) for k, v in held_by_worker_tier(ref).items()} == {
        (wid, tier): n for wid, tiers in load.held().items() for tier, n in tiers.items()
    }


def test_a_restart_opens_a_new_epoch_with_empty_tiers() -> None:
    load = FleetLoad(spec(1.0, 50.0, 1))
    ref, epochs = ReferenceIndex(), {}
    reference_fold(load.join(2), ref, epochs)
    ticks, restarts = load.play()
    assert restarts > 10
    for records in ticks:
        reference_fold(records, ref, epochs)
    assert max(epochs.values()) > 1
    assert not +ref.counters
    assert {k: len(v) for k, v in held_by_worker_tier(ref).items()} == {
        (wid, tier): n for wid, tiers in load.held().items() for tier, n in tiers.items() if n
    }


def test_shards_split_the_same_blocks_by_chain_root() -> None:
    whole, split = FleetLoad(spec(1.0, 5.0, 2)), FleetLoad(spec(1.0, 5.0, 2, shards=2))
    ref = ReferenceIndex()
    shard_refs = [ReferenceIndex(), ReferenceIndex()]
    epochs: dict[int, int] = {}
    shard_epochs: list[dict[int, int]] = [{}, {}]
    records = [whole.join(3), *whole.play()[0]]
    shard_records = [split.join(3), *split.play()[0]]
    for r in records:
        reference_fold(r, ref, epochs)
    for r in shard_records:
        for k in (0, 1):
            reference_fold(r, shard_refs[k], shard_epochs[k], shard=k)
    assert not +ref.counters and not any(+r.counters for r in shard_refs)
    # Each shard's log stands alone (its own event ids, every parent on it), the two
    # hold exactly the blocks of the unsharded log, and each holds only its roots' chains.
    halves = [held_by_worker_tier(r) for r in shard_refs]
    union = {k: halves[0].get(k, set()) | halves[1].get(k, set()) for k in {*halves[0], *halves[1]}}
    assert union == held_by_worker_tier(ref)
    assert reference_digest(shard_refs) == reference_digest([ref])
    for k, r in enumerate(shard_refs):
        roots = {path[0] for blocks in r.blocks.values() for path in blocks.values()}
        assert roots and all(chain_shard(sequence_hashes([root])[0], 2) == k for root in roots)
    assert sum(split.block_events) == sum(whole.block_events)
    assert min(split.block_events) > 0.3 * sum(split.block_events)


@pytest.mark.parametrize("args, message", [
    (["--workers", "0"], "--workers must be at least 1"),
    (["--workers", "4", "--steps", "2,3"], "ending at --workers"),
    (["--workers", "4", "--device-blocks", "8"], "at least one request"),
    (["--workers", "4", "--shards", "0"], "must be positive"),
    (["--workers", "4", "--steps", "2,x,4"], "worker counts separated by commas"),
])
def test_bad_input_is_refused_before_any_broker_starts(args: list[str], message: str) -> None:
    result = CliRunner().invoke(bench, ["fleet-scale", *args, "--json"])
    assert result.exit_code == 2
    assert message in result.output


@pytest.mark.slow
@pytest.mark.kafka
@pytest.mark.parametrize("shards", [1, 2])
def test_fleet_scale_bench_replica_equals_the_reference_fold(kafka_bootstrap: str, shards: int) -> None:
    args = [
        "fleet-scale", "--bootstrap", kafka_bootstrap, "--workers", "6", "--steps", "3,6", "--seconds", "1.5",
        "--request-blocks", "16", "--device-blocks", "64", "--host-blocks", "128", "--disk-blocks", "256",
        "--restarts-per-s", "2", "--partitions", "4", "--route-rate", "100", "--lag-bound-ms", "60000",
        "--shards", str(shards), "--seed", "7", "--json",
    ]
    result = CliRunner().invoke(bench, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, result.stdout
    out = json.loads(lines[0])
    assert out["steps_played"] == [3, 6]

    # The same records, regenerated from the spec, each shard's folded by a reference
    # index of its own.
    load = FleetLoad(LoadSpec("", ("",) * shards, 4, PROFILE, 1.5, 2.0, 7))
    refs = [ReferenceIndex() for _ in range(shards)]
    epochs: list[dict[int, int]] = [{} for _ in range(shards)]
    offered = 0
    for n in out["steps_played"]:
        for records in [load.join(n), *load.play()[0]]:
            offered += sum(reference_fold(records, refs[k], epochs[k], shard=k) for k in range(shards))
    assert not any(+ref.counters for ref in refs)
    assert out["index_digest"] == reference_digest(refs)
    assert out["events_offered"] == out["events_folded"] == offered
    assert out["blocks_held"] == sum(len(b) for ref in refs for b in ref.blocks.values())

    for row in out["steps"]:
        # Offered at the rate derived (restarts lower it: a fresh pool evicts nothing).
        assert 0.6 * row["target_block_events_per_s"] < row["offered_block_events_per_s"] <= 1.05 * row["target_block_events_per_s"]
        # A few tens of thousands of block events/s: the replica keeps up, its lag a
        # fraction of the step (not growing with it) and above the producer's linger.
        assert row["folded_block_events_per_s"] >= 0.7 * row["offered_block_events_per_s"], row
        assert 0 < row["lag_p50_ms"] <= row["lag_p99_ms"] < 1_000 * out["seconds_per_step"], row
        assert row["blocks_held"] <= row["workers"] * (64 + 128 + 256)
        # Tens of thousands of block events/s cost the replicas a few % of a core (0.06 s
        # per step seen): less than one core over the step, whatever else runs.
        assert 0 < row["replica_cpu_s"] < out["seconds_per_step"], row
        assert row["folded_block_events_per_cpu_s"] == pytest.approx(row["block_events"] / row["replica_cpu_s"], rel=0.1)
        if shards == 1:
            assert row["routes"] > 0 and row["route_p50_us"] <= row["route_p99_us"]
        else:
            assert len(row["by_shard"]) == shards
            assert sum(s["block_events"] for s in row["by_shard"]) == row["block_events"]
            assert sum(s["blocks_held"] for s in row["by_shard"]) == row["blocks_held"]
            assert all(s["folded_block_events_per_s"] > 0 for s in row["by_shard"])
    assert out["workers_followed"] in (0, 3, 6)
    assert out["route_errors"] == (0 if shards == 1 else None)
