"""How ``kvstream worker`` stops (issue 26): Ctrl-C exits 130 after the clean stop, the
metrics endpoint binds loopback unless told otherwise, and a cleanly stopped worker
withdraws its blocks at once (``cleared`` on every tier), so that no replica routes to
its cache for the lease it would otherwise keep. A real synthetic worker process against
a real broker; the log is read back and folded as a replica folds it."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from kvstream.events.codec import EventCodec
from kvstream.events.model import Cleared, Tier
from kvstream.replica.fold import LogFold
from kvstream.router import Router
from kvstream.tools.procs import free_port

from .test_publisher import read_batches
from .test_worker_cli import KVSTREAM, scrape


def listening_address(port: int) -> str:
    """The local address a TCP socket listens on for ``port``, from /proc/net/tcp (the
    kernel's view, not the process's word)."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        addr, hex_port = local.split(":")
        if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
            return ".".join(str(int(addr[i : i + 2], 16)) for i in (6, 4, 2, 0))
    raise AssertionError(f"nothing listens on port {port}")


@pytest.mark.slow
def test_ctrl_c_exits_130_after_withdrawing_the_blocks(kafka_topics, tmp_path):
    pytest.importorskip("torch")
    metrics_port = free_port()
    env = {**os.environ, "KVSTREAM_TOPICS__PREFIX": kafka_topics.topics.prefix}
    proc = subprocess.Popen(
        [
            KVSTREAM, "worker", "--engine", "synthetic", "--worker-id", "11", "--bootstrap", kafka_topics.bootstrap,
            "--mode", "passthrough", "--rate", "200", "--device-blocks", "32", "--host-blocks", "64",
            "--metrics-port", str(metrics_port),
        ],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        deadline = time.monotonic() + 120
        metrics: dict[str, float] = {}
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                metrics = scrape(metrics_port)
            except OSError:
                metrics = {}
            if metrics.get("kvstream_worker_blocks_acked_total", 0) > 100:
                break
            time.sleep(0.2)
        assert metrics.get("kvstream_worker_blocks_acked_total", 0) > 100, metrics
        assert listening_address(metrics_port) == "127.0.0.1"
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, out
    assert "Traceback" not in out, out
    assert "withdrawn=True" in out, out

    codec = EventCodec()
    fold = LogFold(Router(), codec)
    most: dict[Tier, int] = {}
    batches = read_batches(kafka_topics)
    for offset, (partition, _, batch) in enumerate(batches):
        assert fold.apply_record(partition, offset, 0, codec.encode(batch)).dlq_reason is None
        for tiers in fold.router.tree_sizes().values():
            for tier, n in tiers.items():
                most[tier] = max(most.get(tier, 0), n)
    # It held blocks on both tiers while it ran...
    assert most[Tier.DEVICE] > 0 and most[Tier.HOST_PINNED] > 0, most
    # ...and its last batch withdrew them all: a cleared per tier of its rank.
    last = batches[-1][2]
    assert {(ev.dp_rank, ev.tier) for ev in last.events if isinstance(ev, Cleared)} == {(0, t) for t in Tier}
    assert all(n == 0 for tiers in fold.router.tree_sizes().values() for n in tiers.values())
