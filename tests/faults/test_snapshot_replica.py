"""Issue 13 (5, 6) against the real broker: a replica whose snapshot directory RocksDB
cannot open still starts (a full replay, the reason noted and counted) and equals the
reference fold; a ``kvstream router`` process whose disk filled up keeps serving, takes
snapshots again once space returns, and exits 0 on SIGTERM with a final snapshot."""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client import generate_latest

from kvstream.replica.snapshot import SnapshotStore
from kvstream.replica.snapshotter import restore_fold
from kvstream.tools.procs import free_port

from tests.faults.helpers import (
    agrees_with_log,
    comparable,
    read_log,
    reference_fold,
    spawn_router,
    stop_process,
    wait_http,
)
from tests.faults.test_snapshot_faults import fill, mount_tmpfs
from tests.replica.helpers import new_fold
from tests.replica.test_replica_kafka import log_records, produce, start, wait_caught_up

pytestmark = [pytest.mark.faults, pytest.mark.kafka]


@pytest.mark.timeout(180)
def test_unopenable_snapshot_store_means_replay_not_down(kafka_topics_factory, tmp_path: Path) -> None:
    settings = kafka_topics_factory(events_partitions=3)
    records, _ = log_records(4)
    produce(settings, records[: len(records) // 2])
    snap = tmp_path / "snap"
    r = start(settings, snapshot_dir=snap)
    try:
        wait_caught_up(r, settings)
        with r.lock:
            r.snapshotter.snapshot_now()
    finally:
        r.stop()
    manifest = next(snap.glob("MANIFEST-*"))
    data = bytearray(manifest.read_bytes())
    data[len(data) // 2] ^= 0x10
    manifest.write_bytes(bytes(data))
    produce(settings, records[len(records) // 2 :])
    r = start(settings, snapshot_dir=snap)  # on main: "Corruption: ..." and no start
    try:
        wait_caught_up(r, settings)
        agrees_with_log(r, settings)
        text = generate_latest(r.metrics.registry).decode()
        assert 'kvstream_snapshot_fallbacks_total{skipped="store"} 1.0' in text, text
        assert any("moved aside" in n for n in r.recovery_notes), r.recovery_notes
        assert list(tmp_path.glob("snap.broken-*")), "the damaged store is kept for inspection"
        with r.lock:
            gen = r.snapshotter.snapshot_now()  # the new store takes snapshots again
        assert gen >= 1
    finally:
        r.stop()


def _metric(port: int, pattern: str) -> float:
    """The sum of the samples whose name (and labels) match ``pattern``."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    return sum(float(v) for v in re.findall(rf"^{pattern} (\S+)$", text, re.M))


@pytest.mark.timeout(240)
def test_disk_full_router_recovers_and_exits_0_with_a_final_snapshot(kafka_topics_factory, tmp_path: Path) -> None:
    mnt = tmp_path / "mnt"
    if not mount_tmpfs(mnt, "32m"):
        pytest.skip("mounting a small tmpfs needs root")
    try:
        failures, meta, blobs, log = _fill_then_free(kafka_topics_factory, tmp_path, mnt)
        ends = {}
        for rec in log:
            ends[rec.partition] = rec.offset + 1
        # The final snapshot holds everything the process read: the whole log.
        assert {p: o for p, o in meta.next_offsets().items() if o} == ends
        fold = new_fold()
        restore_fold(fold, meta, blobs, set(meta.partitions))
        assert comparable(fold) == comparable(reference_fold(log))
        print(f"FAULTS disk_full_router write_failures={failures:.0f} final_generation={meta.gen} rc=0")
    finally:
        shutil.rmtree(mnt / "snap", ignore_errors=True)
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _fill_then_free(kafka_topics_factory, tmp_path: Path, mnt: Path):
    """Run a router with its snapshots on ``mnt``; fill the disk while records arrive,
    free it, SIGTERM (exit 0 asserted); returns the write failures seen, the newest
    snapshot generation and the log."""
    settings = kafka_topics_factory(events_partitions=3)
    records, _ = log_records(6)
    third = len(records) // 3
    port = free_port()
    proc = spawn_router(
        settings, port, tmp_path / "router.log", snapshot_dir=mnt / "snap",
        snapshot_every_records=1, snapshot_every_s=0,
    )
    ballast = None
    try:
        wait_http(f"http://127.0.0.1:{port}/readyz", 60, proc)
        produce(settings, records[:third])
        ballast = fill(mnt)
        produce(settings, records[third : 2 * third])
        deadline = time.monotonic() + 60
        while _metric(port, "kvstream_snapshot_write_failures_total") < 1:
            assert time.monotonic() < deadline, "no snapshot write failed on a full disk"
            time.sleep(0.2)
        failures = _metric(port, "kvstream_snapshot_write_failures_total")
        assert httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=5).status_code == 200
        ballast.unlink()
        ballast = None
        produce(settings, records[2 * third :])
        on_log = len(read_log(settings))
        while _metric(port, "kvstream_records_total") < on_log:  # read it all before SIGTERM
            assert time.monotonic() < deadline + 60, "the router did not catch up"
            time.sleep(0.2)
        stop_process(proc)
        assert proc.returncode == 0, (tmp_path / "router.log").read_text()[-3000:]
    finally:
        stop_process(proc, signal.SIGKILL)
        if ballast is not None:
            ballast.unlink()
    store = SnapshotStore(mnt / "snap")
    loaded, skipped = store.load_latest()
    store.close()
    assert loaded is not None and not skipped, skipped
    return failures, *loaded, read_log(settings)
