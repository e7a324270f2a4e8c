"""``kvstream bench fleet-scale`` (issue 35): its generator against the reference index,
and a small run against the real broker whose replica must hold what a reference fold of
the very same records holds."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from bench import bench
from bench.fleet_scale import TIERS, FleetLoad, LoadSpec, WorkerProfile, index_digest
from kvstream.events.codec import EventCodec
from kvstream.events.model import Removed, Stored
from kvstream.router.index import WorkerKey

from tests.router.reference import ReferenceIndex

PROFILE = WorkerProfile(request_blocks=16, device_blocks=64, host_blocks=128, disk_blocks=256)


def reference_fold(records: list[tuple[int, bytes]], ref: ReferenceIndex, epochs: dict[int, int]) -> int:
    """Fold encoded records into ``ref`` as a replica does (a new epoch wipes the
    worker, DESIGN.md §2); returns the events."""
    codec = EventCodec()
    n = 0
    for wid, value in records:
        batch = codec.decode(value)
        assert batch.worker_id == wid
        if epochs.get(wid) != batch.epoch:
            ref.remove_worker(wid)
            epochs[wid] = batch.epoch
        for ev in batch.events:
            ref.apply(ev)
        n += len(batch.events)
    return n


def reference_digest(ref: ReferenceIndex) -> str:
    return index_digest({(k.worker_id, k.dp_rank, t.value): list(b) for (t, k), b in ref.blocks.items()})


def test_streams_fold_to_what_the_workers_hold_at_the_rate_derived() -> None:
    spec = LoadSpec("", "", 1, PROFILE, seconds=2.0, restarts_per_s=0.0, seed=3)
    load = FleetLoad(spec)
    ref, epochs = ReferenceIndex(), {}
    joined, fill_events = load.join(4)
    reference_fold(joined, ref, epochs)
    # A joining worker publishes full tiers: its disk, and the newest chains on host and device.
    assert fill_events == 4 * (256 + 128 + 64)
    ticks, counts = load.play()
    stored = removed = 0
    codec = EventCodec()
    for records in ticks:
        for _, value in records:
            for ev in codec.decode(value).events:
                stored += len(ev.block_hashes) if type(ev) is Stored else 0
                removed += len(ev.block_hashes) if type(ev) is Removed else 0
        reference_fold(records, ref, epochs)
    assert not +ref.counters  # nothing rejected: every parent on its tier, every remove known
    # Full tiers: every block stored is evicted too, on each of the three tiers.
    assert stored == removed == counts["block_events"] // 2
    assert counts["block_events"] == pytest.approx(4 * PROFILE.events_per_s * spec.seconds, rel=0.1)
    sizes = ref.tree_sizes()
    assert {(k.worker_id, t.value): n for k, s in sizes.items() for t, n in s.items() if t in TIERS} == {
        (wid, tier): n for wid, tiers in load.held().items() for tier, n in tiers.items()
    }


def test_a_restart_opens_a_new_epoch_with_empty_tiers() -> None:
    load = FleetLoad(LoadSpec("", "", 1, PROFILE, seconds=1.0, restarts_per_s=50.0, seed=1))
    ref, epochs = ReferenceIndex(), {}
    reference_fold(load.join(2)[0], ref, epochs)
    ticks, counts = load.play()
    assert counts["restarts"] > 10
    for records in ticks:
        reference_fold(records, ref, epochs)
    assert max(epochs.values()) > 1
    assert not +ref.counters
    assert {k.worker_id: sum(s.values()) for k, s in ref.tree_sizes().items()} == {
        wid: sum(tiers.values()) for wid, tiers in load.held().items()
    }


@pytest.mark.parametrize("args, message", [
    (["--workers", "0"], "--workers must be at least 1"),
    (["--workers", "4", "--steps", "2,3"], "ending at --workers"),
    (["--workers", "4", "--device-blocks", "8"], "at least one request"),
])
def test_bad_input_is_refused_before_any_broker_starts(args: list[str], message: str) -> None:
    result = CliRunner().invoke(bench, ["fleet-scale", *args, "--json"])
    assert result.exit_code == 2
    assert message in result.output


@pytest.mark.slow
@pytest.mark.kafka
def test_fleet_scale_bench_replica_equals_the_reference_fold(kafka_bootstrap: str) -> None:
    args = [
        "fleet-scale", "--bootstrap", kafka_bootstrap, "--workers", "6", "--steps", "3,6", "--seconds", "1.5",
        "--request-blocks", "16", "--device-blocks", "64", "--host-blocks", "128", "--disk-blocks", "256",
        "--restarts-per-s", "2", "--partitions", "4", "--route-rate", "100", "--lag-bound-ms", "60000",
        "--seed", "7", "--json",
    ]
    result = CliRunner().invoke(bench, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, result.stdout
    out = json.loads(lines[0])
    assert out["steps_played"] == [3, 6]

    # The same records, regenerated from the spec, folded by the reference index.
    load = FleetLoad(LoadSpec("", "", 4, PROFILE, seconds=1.5, restarts_per_s=2.0, seed=7))
    ref, epochs = ReferenceIndex(), {}
    offered = 0
    for n in out["steps_played"]:
        offered += reference_fold(load.join(n)[0], ref, epochs)
        ticks, _ = load.play()
        for records in ticks:
            offered += reference_fold(records, ref, epochs)
    assert not +ref.counters
    assert out["index_digest"] == reference_digest(ref)
    assert out["events_offered"] == out["events_folded"] == offered
    assert out["blocks_held"] == sum(len(b) for b in ref.blocks.values())

    for row in out["steps"]:
        # Offered at the rate derived (restarts lower it: a fresh pool evicts nothing).
        assert 0.6 * row["target_block_events_per_s"] < row["offered_block_events_per_s"] <= 1.05 * row["target_block_events_per_s"]
        # A few tens of thousands of block events/s: the replica keeps up, its lag a
        # fraction of the step (not growing with it) and above the producer's linger.
        assert row["folded_block_events_per_s"] >= 0.7 * row["offered_block_events_per_s"], row
        assert 0 < row["lag_p50_ms"] <= row["lag_p99_ms"] < 1_000 * out["seconds_per_step"], row
        assert row["routes"] > 0 and row["route_p50_us"] <= row["route_p99_us"]
        assert row["blocks_held"] <= row["workers"] * (64 + 128 + 256)
    assert out["workers_followed"] in (0, 3, 6)
    assert out["route_errors"] == 0
