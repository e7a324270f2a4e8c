"""``kvstream demo``: the whole system on one machine, in a few minutes.

Starts the local Kafka broker (unless ``--bootstrap``), creates topics, starts two router
replicas as separate ``kvstream router`` processes, and runs synthetic workers (real CPU
tiered pools, consolidator, Kafka publisher) in this process. A workload with shared
prefixes is routed through the replicas' HTTP API, alternating between them; halfway,
one replica is killed with SIGKILL and restarted from its snapshot. The same workload is
then run on fresh workers with round-robin and random placement, and a table compares
the cache hit rates, says whether the replicas agree, and how fast the restart was.
"""

from __future__ import annotations

import gc
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import click
import httpx
from tqdm import tqdm

from kvstream.logs import configure_logging
from kvstream.kafka.local_broker import start_local_cluster, stop_local_cluster
from kvstream.kafka.topics import ensure_topics
from kvstream.settings import Settings, TopicSettings

KVSTREAM = str(Path(sys.executable).with_name("kvstream"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ReplicaProcess:
    """A ``kvstream router`` child process with its own port and snapshot directory."""

    name: str
    settings: Settings
    snapshot_dir: Path
    log_path: Path
    port: int = field(default_factory=_free_port)
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        env = {
            **os.environ,
            "KVSTREAM_TOPICS__PREFIX": self.settings.topics.prefix,
            "KVSTREAM_TOPICS__EVENTS_PARTITIONS": str(self.settings.topics.events_partitions),
            "KVSTREAM_REPLICA__SNAPSHOT_EVERY_S": "2",
            "KVSTREAM_REPLICA__TICK_INTERVAL_S": "1",
            "KVSTREAM_LOG_FORMAT": "json",
        }
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [KVSTREAM, "router", "--bootstrap", str(self.settings.bootstrap), "--port", str(self.port),
             "--snapshot-dir", str(self.snapshot_dir)],
            env=env, stdout=log, stderr=subprocess.STDOUT,
        )

    def wait_ready(self, timeout: float = 120.0) -> float:
        """Seconds until /readyz answers 200."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc is not None and self.proc.poll() is not None:
                raise click.ClickException(f"replica {self.name} exited; see {self.log_path}")
            try:
                if httpx.get(self.url + "/readyz", timeout=2).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise click.ClickException(f"replica {self.name} not ready after {timeout}s; see {self.log_path}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()

    def blocks_view(self) -> dict:
        workers = httpx.get(self.url + "/v1/workers", timeout=10).json()["workers"]
        # The workers of the fold (a registered worker is listed before its first event).
        return {w: v["ranks"] for w, v in workers.items() if "epoch" in v}


@dataclass
class PolicyResult:
    policy: str
    requests: int = 0
    blocks: int = 0
    device_hits: int = 0
    lower_hits: int = 0
    seconds: float = 0.0

    @property
    def hit_rate(self) -> float:
        return (self.device_hits + self.lower_hits) / self.blocks if self.blocks else 0.0

    @property
    def device_hit_rate(self) -> float:
        return self.device_hits / self.blocks if self.blocks else 0.0


def workload(requests: int, seed: int) -> list[list[int]]:
    """Prompts sharing system prompts and growing conversations, more than one worker's
    G1 can hold at once, so that where a request goes matters."""
    from kvstream.worker.synthetic import PromptSetOptions, shared_prefix_prompts

    return list(shared_prefix_prompts(PromptSetOptions(
        prompts=requests, prefixes=24, prefix_blocks=16, suffix_blocks=2, seed=seed,
    )))


@contextmanager
def nodes(settings: Settings, count: int, work: Path, tag: str) -> Iterator[dict[int, object]]:
    from kvstream.worker.announce import register_synthetic
    from kvstream.worker.node import SyntheticNode, SyntheticNodeOptions
    from kvstream.worker.publisher import PublisherOptions

    made: dict[int, SyntheticNode] = {}
    # Registered, as `kvstream worker` registers them: the replicas admit no others.
    register_synthetic(settings, range(1, count + 1))
    try:
        for wid in range(1, count + 1):
            disk = work / f"{tag}-disk"
            disk.mkdir(parents=True, exist_ok=True)
            made[wid] = SyntheticNode(settings, SyntheticNodeOptions(
                PublisherOptions(worker_id=wid, lease_ms=30_000, heartbeat_s=1.0),
                device_blocks=160, host_blocks=320, disk_blocks=None, disk_dir=disk,
            ))
        yield made
    finally:
        for wid in list(made):
            made[wid].close()
        # Drop the Kafka clients now, before the broker goes away under them.
        made.clear()
        gc.collect()


def run_policy(
    policy: str, prompts: list[list[int]], workers: dict, choose: Callable[[int, list[int]], int],
    on_request: Callable[[int], None] | None = None,
) -> PolicyResult:
    result = PolicyResult(policy)
    t0 = time.monotonic()
    for i, tokens in enumerate(tqdm(prompts, desc=f"{policy:>11}", unit="req", file=sys.stderr, leave=False)):
        if on_request is not None:
            on_request(i)
        wid = choose(i, tokens)
        r = workers[wid].run_prompt(tokens)
        for node in workers.values():  # heartbeats and lingering batches of idle workers
            node.poll()
        result.requests += 1
        result.blocks += r.blocks
        result.device_hits += r.device_hits
        result.lower_hits += r.host_hits + r.disk_hits
    result.seconds = time.monotonic() - t0
    return result


@click.command("demo")
@click.option("--bootstrap", help="Use this Kafka cluster instead of starting the local broker.")
@click.option("--workers", "n_workers", default=3, show_default=True, type=click.IntRange(2, 16))
@click.option("--requests", default=600, show_default=True, type=click.IntRange(20))
@click.option("--seed", default=0, show_default=True)
@click.option("--keep", is_flag=True, help="Keep the working directory (replica logs, snapshots).")
@click.option("--verbose", is_flag=True, help="Show the components' logs.")
def demo(bootstrap: str | None, n_workers: int, requests: int, seed: int, keep: bool, verbose: bool) -> None:
    """Run workers, two replicas and a workload end to end; kill and restart a replica."""
    if not verbose:
        configure_logging(level="WARNING")
    work = Path(tempfile.mkdtemp(prefix="kvstream-demo-"))
    started = time.monotonic()
    try:
        with ExitStack() as stack:
            if bootstrap is None:
                click.echo("starting the local Kafka broker ...", err=True)
                cluster = start_local_cluster(1, work / "kafka", owner_pid=os.getpid())
                stack.callback(stop_local_cluster, cluster.dir)
                bootstrap = cluster.bootstrap
            prefix = f"demo.{uuid.uuid4().hex[:8]}."
            settings = Settings(bootstrap=bootstrap, topics=TopicSettings(prefix=prefix, events_partitions=4))
            ensure_topics(settings)
            replicas = [ReplicaProcess(n, settings, work / f"snap-{n}", work / f"replica-{n}.log") for n in "AB"]
            for rp in replicas:
                rp.start()
                stack.callback(rp.stop)
            for rp in replicas:
                rp.wait_ready()
            prompts = workload(requests, seed)
            client = httpx.Client(timeout=30)
            stack.callback(client.close)
            restart_s: list[float] = []
            a, b = replicas

            def kill_and_restart(i: int) -> None:
                if i == requests // 2:
                    b.kill()
                    b.start()
                elif i == requests // 2 + 20:
                    # B restores its snapshot and reads the tail while A keeps routing.
                    restart_s.append(b.wait_ready())

            def via_replicas(i: int, tokens: list[int]) -> int:
                target = a if (i % 2 == 0 or b.proc is None or not restart_s and i >= requests // 2) else b
                rid = f"req-{i}"
                r = client.post(target.url + "/v1/route", json={"token_ids": tokens, "request_id": rid})
                if r.status_code != 200:
                    raise click.ClickException(f"route failed ({r.status_code}): {r.text}")
                # The request runs at once in this demo: its prefill and its end follow.
                client.post(target.url + f"/v1/requests/{rid}/prefill_done")
                client.delete(target.url + f"/v1/requests/{rid}")
                return r.json()["worker_id"]

            with nodes(settings, n_workers, work, "kv") as kv_workers:
                # Workers announce themselves (`cleared`) before the first request.
                _wait_known(a, kv_workers)
                kv = run_policy("kv", prompts, kv_workers, via_replicas, kill_and_restart)
                views = _wait_agree(a, b)
            rng = random.Random(seed)
            others = [
                ("round_robin", lambda i, _t: i % n_workers + 1),
                ("random", lambda i, _t: rng.randrange(n_workers) + 1),
            ]
            results = [kv]
            for name, choose in others:
                ps = settings.model_copy(update={"topics": TopicSettings(prefix=f"{prefix}{name}.", events_partitions=4)})
                ensure_topics(ps)
                with nodes(ps, n_workers, work, name) as fresh:
                    results.append(run_policy(name, prompts, fresh, choose))
            _print_report(results, views, restart_s, time.monotonic() - started)
    finally:
        if keep:
            click.echo(f"working directory kept: {work}", err=True)
        else:
            shutil.rmtree(work, ignore_errors=True)


def _wait_known(replica: ReplicaProcess, workers: dict, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for node in workers.values():
            node.poll()
        if len(replica.blocks_view()) >= len(workers):
            return
        time.sleep(0.1)
    raise click.ClickException("the workers never reached the replicas")


def _wait_agree(a: ReplicaProcess, b: ReplicaProcess, timeout: float = 30.0) -> tuple[dict, dict, bool]:
    """Both replicas' per-worker block counts, once equal (or after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        va, vb = a.blocks_view(), b.blocks_view()
        if va == vb or time.monotonic() > deadline:
            return va, vb, va == vb
        time.sleep(0.2)


def _print_report(results: list[PolicyResult], views: tuple[dict, dict, bool], restart_s: list[float], total_s: float) -> None:
    click.echo("")
    click.echo(f"{'policy':<12} {'requests':>8} {'prefix hit rate':>16} {'device hit rate':>16}")
    for r in results:
        click.echo(f"{r.policy:<12} {r.requests:>8} {r.hit_rate:>16.1%} {r.device_hit_rate:>16.1%}")
    kv = results[0]
    click.echo(f"(kv: routed over HTTP by the two replicas, {1000 * kv.seconds / max(kv.requests, 1):.1f} ms per request "
               "including route, run and release)")
    va, vb, agree = views
    blocks = sum(n for ranks in va.values() for tiers in ranks.values() for n in tiers.values())
    click.echo("")
    click.echo(f"replicas agree: {'yes' if agree else 'NO'} ({len(va)} workers, {blocks} indexed blocks on each)")
    if restart_s:
        click.echo(f"replica B killed with SIGKILL and restarted from its snapshot: ready in {restart_s[0]:.2f} s")
    click.echo(f"demo took {total_s:.0f} s")
    if not agree:
        raise click.ClickException("the replicas disagree")
