"""``kvstream demo`` end to end on the session's broker (the README's first command runs
the same thing with its own broker): emulated engines, bridges, two replicas, the
conversation trace (or the built-in workload) through the openai SDK."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

KVSTREAM = str(Path(sys.executable).with_name("kvstream"))
_ROW = re.compile(r"^(kvstream kv \(2 replicas\)|round-robin)\s+(\d+)\s+(\d+)\s+\d+ms\s+\d+ms\s+([\d.]+)%$", re.M)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_demo_beats_round_robin_and_recovers_a_replica(kafka_bootstrap: str) -> None:
    proc = subprocess.run(
        [KVSTREAM, "demo", "--bootstrap", kafka_bootstrap, "--engines", "4", "--requests", "400", "--speed", "8", "--load", "0.5"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=360,
    )
    assert proc.returncode == 0, proc.stdout[-3000:]
    rows = {m[1]: (int(m[2]), int(m[3]), float(m[4])) for m in _ROW.finditer(proc.stdout)}
    assert set(rows) == {"kvstream kv (2 replicas)", "round-robin"}, proc.stdout[-3000:]
    kv, rr = rows["kvstream kv (2 replicas)"], rows["round-robin"]
    assert kv[0] == rr[0] == 400 and kv[1] == rr[1] == 0  # every request served, none failed
    assert kv[2] > rr[2], proc.stdout[-2000:]  # the engines' own cached-token share
    restored = re.search(r"restarted from its snapshot \((\d+) blocks restored\): ready in ([\d.]+) s", proc.stdout)
    assert restored is not None and int(restored[1]) > 0, proc.stdout[-2000:]
