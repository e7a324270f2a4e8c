"""Shared pieces of the fault suite: reading the log back, the reference fold, and
running ``kvstream router`` as a real process (so that it can be killed with SIGKILL)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
from confluent_kafka import Consumer, KafkaError, TopicPartition

from kvstream.kafka.config import consumer_config
from kvstream.replica.authority import authority_from_settings
from kvstream.replica.fold import LogFold
from kvstream.replica.record import Record, read_record
from kvstream.router import Router
from kvstream.settings import FoldSettings, Settings

from tests.replica.helpers import CODEC
from tests.replica.test_snapshot import state

ROOT = Path(__file__).resolve().parents[2]
KVSTREAM = ROOT / ".venv" / "bin" / "kvstream"


def read_log(settings: Settings, timeout: float = 60.0) -> list[Record]:
    """Every record of the events topic up to its current end, in offset order per
    partition (what a replica that never failed would have read)."""
    topic = settings.topics.name("events")
    c = Consumer(consumer_config(settings))
    try:
        parts = sorted(c.list_topics(topic, timeout=10).topics[topic].partitions)
        bounds = {p: c.get_watermark_offsets(TopicPartition(topic, p), timeout=10) for p in parts}
        todo = {p for p, (low, high) in bounds.items() if high > low}
        c.assign([TopicPartition(topic, p, bounds[p][0]) for p in todo])
        out: list[Record] = []
        deadline = time.monotonic() + timeout
        while todo:
            assert time.monotonic() < deadline, f"log not read back in {timeout}s: {todo} left"
            for m in c.consume(1000, 0.2):
                err = m.error()
                if err is not None:
                    assert err.code() == KafkaError._PARTITION_EOF, str(err)
                    continue
                p = m.partition()
                if p not in todo:
                    continue
                out.append(read_record(m))
                if m.offset() + 1 >= bounds[p][1]:
                    todo.discard(p)
        out.sort(key=lambda r: (r.partition, r.offset))
        return out
    finally:
        c.close()


def reference_fold(records: list[Record], fold_settings: FoldSettings | None = None) -> LogFold:
    """A fresh fold fed ``records`` in offset order, with the authority a replica with
    ``fold_settings`` (default: the default settings) applies: the truth it must equal."""
    fold = LogFold(Router(), CODEC, authority_from_settings(fold_settings or FoldSettings()))
    for r in records:
        fold.apply(r)
    return fold


def comparable(fold: LogFold) -> tuple:
    """``state(fold)`` without partitions that were never read (a snapshot may list an
    empty partition that a fresh fold never saw)."""
    workers, logs, parts = state(fold)
    return workers, logs, {p: v for p, v in parts.items() if v[0] > 0}


def agrees_with_log(replica, settings: Settings) -> LogFold:
    """Assert that the replica's whole state equals the reference fold of the records it
    has read (replicas append log-clock ticks, so the log may have grown since);
    returns that reference fold."""
    with replica.lock:
        offsets = replica.fold.next_offsets()
        mine = comparable(replica.fold)
    truth = reference_fold([r for r in read_log(settings) if r.offset < offsets.get(r.partition, 0)], settings.fold)
    assert mine == comparable(truth), f"{replica.replica_id} differs from the reference fold"
    return truth


def router_env(settings: Settings, **replica: object) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        KVSTREAM_TOPICS__PREFIX=settings.topics.prefix,
        KVSTREAM_LOG_LEVEL="WARNING",
        KVSTREAM_REPLICA__TICK_INTERVAL_S="3600",
    )
    env.pop("KVSTREAM_CONFIG", None)
    for k, v in replica.items():
        env[f"KVSTREAM_REPLICA__{k.upper()}"] = str(v)
    return env


def spawn_router(settings: Settings, port: int, log_path: Path, **replica: object) -> subprocess.Popen:
    """``kvstream router`` on loopback, its output in ``log_path``."""
    assert settings.bootstrap
    with open(log_path, "ab") as out:
        return subprocess.Popen(
            [str(KVSTREAM), "router", "--bootstrap", settings.bootstrap, "--port", str(port)],
            env=router_env(settings, **replica), stdout=out, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, cwd=ROOT,
        )


def stop_process(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 30.0) -> None:
    """Stop a process this suite started (SIGTERM, then SIGKILL); waits for it."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)


def wait_http(url: str, timeout: float, proc: subprocess.Popen | None = None, ok=(200,)) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"process exited with {proc.returncode} before {url} answered")
        try:
            r = httpx.get(url, timeout=2.0)
            if r.status_code in ok:
                return r
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"{url} did not answer {ok} within {timeout}s")
        time.sleep(0.1)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")
