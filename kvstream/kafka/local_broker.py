"""Python side of the local development broker: a thin wrapper around ops/kafka/broker.sh,
which owns the whole life cycle (jars, storage format, ports, pid files)."""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from kvstream.kafka.errors import BrokerError

#: The broker script; the local broker needs a source checkout (the script is not packaged).
SCRIPT = Path(__file__).resolve().parents[2] / "ops" / "kafka" / "broker.sh"

#: First start downloads the jars (~45 MB); three nodes on a busy 2-core machine are slow.
START_TIMEOUT_S = 900.0
STOP_TIMEOUT_S = 120.0

_STATUS_LINE = re.compile(r"^node (\d+) (running pid=(\d+)|stopped)$")


@dataclass(frozen=True)
class LocalCluster:
    bootstrap: str
    dir: Path
    brokers: int


@dataclass(frozen=True)
class ClusterStatus:
    #: node index → pid, or None where the node is not running.
    nodes: dict[int, int | None]
    bootstrap: str | None

    @property
    def running(self) -> bool:
        return bool(self.nodes) and all(pid is not None for pid in self.nodes.values())


def default_cluster_dir() -> Path:
    """Where ``kvstream broker`` keeps its cluster; the same default as broker.sh."""
    if explicit := os.environ.get("KVSTREAM_BROKER_DIR"):
        return Path(explicit)
    cache = os.environ.get("KVSTREAM_CACHE") or str(Path.home() / ".cache" / "kvstream")
    return Path(cache) / "broker"


def _run(args: list[str], timeout: float) -> str:
    if not SCRIPT.is_file():
        raise BrokerError(f"{SCRIPT} not found: the local broker needs a kvstream source checkout")
    try:
        proc = subprocess.run(
            ["bash", str(SCRIPT), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired as exc:
        raise BrokerError(f"broker.sh {args[0]} did not finish within {timeout:.0f}s") from exc
    # Exit 3 is status's "some node is down": an answer, not a failure.
    if proc.returncode != 0 and not (args[0] == "status" and proc.returncode == 3):
        detail = proc.stderr.strip()[-3000:] or proc.stdout.strip()[-3000:]
        raise BrokerError(f"broker.sh {args[0]} failed (exit {proc.returncode}): {detail}")
    return proc.stdout


def fetch_jars(timeout: float = START_TIMEOUT_S) -> Path:
    """Resolve the Kafka jars into the cache (once); returns the folder."""
    return Path(_run(["fetch"], timeout).strip())


def start_local_cluster(
    brokers: int = 1,
    dir: str | Path | None = None,
    *,
    owner_pid: int | None = None,
    timeout: float = START_TIMEOUT_S,
) -> LocalCluster:
    """Start a fresh KRaft cluster of 1 or 3 combined nodes on loopback and wait until it
    serves clients. With ``owner_pid``, the cluster stops itself once that process is gone."""
    if brokers not in (1, 3):
        raise BrokerError(f"brokers must be 1 or 3, not {brokers}")
    path = Path(dir) if dir is not None else default_cluster_dir()
    args = ["start", "--brokers", str(brokers), "--dir", str(path)]
    if owner_pid is not None:
        args += ["--owner-pid", str(owner_pid)]
    bootstrap = _run(args, timeout).strip().splitlines()[-1]
    return LocalCluster(bootstrap=bootstrap, dir=path.resolve(), brokers=brokers)


def stop_local_cluster(dir: str | Path | None = None, timeout: float = STOP_TIMEOUT_S) -> None:
    """Stop every node of the cluster in ``dir`` and wait until they are gone."""
    path = Path(dir) if dir is not None else default_cluster_dir()
    _run(["stop", "--dir", str(path)], timeout)


def cluster_status(dir: str | Path | None = None) -> ClusterStatus:
    path = Path(dir) if dir is not None else default_cluster_dir()
    nodes: dict[int, int | None] = {}
    bootstrap: str | None = None
    for line in _run(["status", "--dir", str(path)], 60.0).splitlines():
        if m := _STATUS_LINE.match(line):
            nodes[int(m.group(1))] = int(m.group(3)) if m.group(3) else None
        elif line.startswith("bootstrap "):
            bootstrap = line.split(" ", 1)[1] or None
    return ClusterStatus(nodes=nodes, bootstrap=bootstrap)


def local_bootstrap(dir: str | Path | None = None) -> str | None:
    """The bootstrap of the running local cluster in ``dir``, or None if none runs there."""
    path = Path(dir) if dir is not None else default_cluster_dir()
    # broker.sh writes this file once the cluster serves; without it nothing runs there.
    if not (path / "bootstrap").is_file():
        return None
    # The file outlives nodes that were killed rather than stopped.
    status = cluster_status(path)
    return status.bootstrap if status.running else None
