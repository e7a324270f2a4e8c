"""Test tooling over ops/kafka/broker.sh that the package does not need: killing and
restarting one node of a local cluster (fault tests), and Kafka's own command-line tools
(an independent view of what kvstream wrote)."""

from __future__ import annotations

import signal as _signal
import subprocess
from pathlib import Path

from kvstream.kafka.local_broker import SCRIPT, START_TIMEOUT_S


def _broker_sh(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    assert SCRIPT.is_file(), f"{SCRIPT} not found: the local broker needs a kvstream source checkout"
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def _checked(*args: str, timeout: float) -> None:
    proc = _broker_sh(*args, timeout=timeout)
    detail = proc.stderr.strip()[-3000:] or proc.stdout.strip()[-3000:]
    assert proc.returncode == 0, f"broker.sh {args[0]} failed (exit {proc.returncode}): {detail}"


def kill_broker(dir: str | Path, index: int, signal: _signal.Signals = _signal.SIGKILL) -> None:
    """Send ``signal`` to node ``index`` (1-based); for TERM/KILL/INT, return once it is gone."""
    _checked("kill-node", "--dir", str(dir), "--index", str(index), "--signal", signal.name[3:], timeout=120.0)


def restart_broker(dir: str | Path, index: int, timeout: float = START_TIMEOUT_S) -> None:
    """Relaunch a stopped node ``index`` with its old config and data; returns once it serves."""
    _checked("start-node", "--dir", str(dir), "--index", str(index), timeout=timeout)


def run_tool(name: str, *args: str, timeout: float = 300.0) -> subprocess.CompletedProcess[str]:
    """Run one of Kafka's own command-line tools (``broker.sh tool``: console-consumer,
    consumer-groups, get-offsets) with ``args``, against any cluster; its exit status and
    output are the caller's to judge. The tools' jars are fetched on first use."""
    return _broker_sh("tool", name, *args, timeout=timeout)
