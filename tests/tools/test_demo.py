"""``kvstream demo`` end to end on the session's broker (the README's first command runs
the same thing with its own broker)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

KVSTREAM = str(Path(sys.executable).with_name("kvstream"))


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_demo_runs_and_replicas_agree(kafka_bootstrap: str) -> None:
    pytest.importorskip("torch")
    proc = subprocess.run(
        [KVSTREAM, "demo", "--bootstrap", kafka_bootstrap, "--requests", "80"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=360,
    )
    assert proc.returncode == 0, proc.stdout[-3000:]
    out = proc.stdout
    for policy in ("kv", "round_robin", "random"):
        assert f"\n{policy} " in out
    assert "replicas agree: yes" in out
    assert "restarted from its snapshot: ready in" in out
