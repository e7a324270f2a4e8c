"""``kvstream demo``: an emulated fleet behind two kvstream replicas, on one machine.

Starts the local Kafka broker (unless ``--bootstrap``), ``--engines`` emulated vLLM
engines (``kvstream emulate``, with their ZMQ KV events) and their bridges (``kvstream
worker --engine vllm``, which register each engine on kvstream.workers), and two router
replicas serving the OpenAI API. A slice of the conversation trace is replayed through
the replicas in turn with the official ``openai`` SDK (kvstream.tools.fleet: prompts as
words of a real tokenizer.json that the engines and the replicas' gateways both load,
one token each; the engines run ``--speed`` times faster than real time and the trace is
replayed ``--speed`` × ``--load`` times faster, so that ``--load`` 1 is the trace's real
load). Halfway, replica B is drained
(no new requests), killed with SIGKILL and restarted from its snapshot. The same slice
then goes to a fresh set of engines in turn (round-robin, straight to the engines), and
a table compares requests, TTFT and the engines' own cached-token share. Everything
started is stopped on exit, Ctrl-C or failure.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
import uuid
from contextlib import ExitStack
from pathlib import Path

import click

from kvstream.kafka.local_broker import start_local_cluster, stop_local_cluster
from kvstream.kafka.topics import ensure_topics
from kvstream.logs import configure_logging
from kvstream.settings import Settings, TopicSettings
from kvstream.tools import fleet
from kvstream.tools.procs import port_taken


class _TwoReplicas:
    """Sends requests to A and B in turn; drains, kills and restarts B at ``kill_at``."""

    def __init__(self, a: fleet.Replica, b: fleet.Replica, kill_at: int, workers: int) -> None:
        self.a, self.b, self.kill_at, self.workers = a, b, kill_at, workers
        self.inflight = {a.url: 0, b.url: 0, b.url + "#restarted": 0}
        self.target: dict[int, str] = {}
        self.b_up = True
        self.restart_s: float | None = None
        self.restored_blocks = 0.0
        self.error: BaseException | None = None
        self._restarter: threading.Thread | None = None

    def choose(self, i: int) -> str:
        if i == self.kill_at:
            self.b_up = False
        # The restarted B gets a connection pool of its own (the old one's are dead).
        url = (self.b.url + ("#restarted" if self.restart_s else "")) if self.b_up and i % 2 else self.a.url
        self.target[i] = url
        self.inflight[url] += 1
        return url

    def done(self, i: int) -> None:
        self.inflight[self.target.pop(i)] -= 1
        if not self.b_up and self._restarter is None and self.inflight[self.b.url] == 0:
            self._restarter = threading.Thread(target=self._restart, daemon=True)
            self._restarter.start()

    def _restart(self) -> None:
        try:
            self.b.kill()
            t0 = time.monotonic()
            self.b.start(restart=True)
            self.b.wait_ready(self.workers)
            self.restart_s = time.monotonic() - t0
            self.restored_blocks = self.b.snapshot_blocks()
            self.b_up = True
        except BaseException as exc:  # reported by the demo after the replay
            self.error = exc

    def join(self) -> None:
        if self._restarter is not None:
            self._restarter.join(120)
        if self.error is not None:
            raise click.ClickException(f"replica B did not come back: {self.error}")


@click.command("demo")
@click.option("--bootstrap", help="Use this Kafka cluster instead of starting the local broker.")
@click.option("--engines", "n_engines", default=4, show_default=True, type=click.IntRange(2, 16),
              help="Emulated vLLM engines (each with its bridge).")
@click.option("--requests", default=800, show_default=True, type=click.IntRange(20),
              help="Requests from the start of the trace.")
@click.option("--speed", default=8.0, show_default=True, type=click.FloatRange(min=0.1),
              help="The engines run this many times faster than real time.")
@click.option("--load", default=1.0, show_default=True, type=click.FloatRange(min=0.05),
              help="The trace's rate relative to real time (at the engines' speed).")
@click.option("--trace", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="A Mooncake JSONL trace [default: ../shared/traces/ beside the repository, else a built-in workload].")
@click.option("--policy", type=click.Choice(["kv", "ttft"]), default="kv", show_default=True,
              help="The replicas' routing policy ([router] policy).")
@click.option("--gpu-blocks", type=click.IntRange(64), help="G1 blocks of 16 tokens per engine [default: the "
              "emulator's 16,384 divided by the prompts' scale, 16: a real engine's footprint].")
@click.option("--port", type=click.IntRange(1, 65535), help="Replica A's port (refused if taken) [default: a free one].")
@click.option("--keep", is_flag=True, help="Keep the working directory (snapshots).")
@click.option("--verbose", is_flag=True, help="Show the components' logs.")
def demo(bootstrap: str | None, n_engines: int, requests: int, speed: float, load: float, trace: Path | None,
         policy: str, gpu_blocks: int | None, port: int | None, keep: bool, verbose: bool) -> None:
    """Emulated engines, two replicas, a trace slice through the OpenAI API; a replica killed and restarted; against round-robin."""
    if not verbose:
        configure_logging(level="WARNING")
    if port is not None and port_taken(port):
        raise click.ClickException(f"port {port} on 127.0.0.1 is taken")
    trace = trace or fleet.default_trace()
    reqs, source = fleet.load_requests(trace, requests, speed * load)
    scale = fleet.Scale(gpu_blocks=gpu_blocks, tokenizer=fleet.local_tokenizer())
    work = Path(tempfile.mkdtemp(prefix="kvstream-demo-"))
    try:
        with ExitStack() as stack:
            if bootstrap is None:
                click.echo("starting the local Kafka broker ...", err=True)
                cluster = start_local_cluster(1, work / "kafka", owner_pid=os.getpid())
                stack.callback(stop_local_cluster, cluster.dir)
                bootstrap = cluster.bootstrap
            prefix = f"demo.{uuid.uuid4().hex[:8]}."
            ensure_topics(Settings(bootstrap=bootstrap, topics=TopicSettings(prefix=prefix)))
            click.echo(f"starting {n_engines} emulated engines, their bridges and two replicas ...", err=True)
            engines = fleet.start_engines(n_engines, scale, speed)
            stack.callback(fleet.stop_all, [e.proc for e in engines])
            bridges = [fleet.start_bridge(e, bootstrap, prefix) for e in engines]
            stack.callback(fleet.stop_all, bridges)
            a = fleet.Replica("A", bootstrap, prefix, policy, work / "snap-A", scale.tokenizer,
                              **({"port": port} if port else {}))
            b = fleet.Replica("B", bootstrap, prefix, policy, work / "snap-B", scale.tokenizer)
            for r in (a, b):
                r.start()
                stack.callback(r.stop)
            for r in (a, b):
                r.wait_ready(n_engines)
            click.echo(f"replaying {len(reqs)} requests of {source} at {speed * load:g}x through the replicas ...", err=True)
            pair = _TwoReplicas(a, b, len(reqs) // 2, n_engines)
            kv = fleet.replay(reqs, scale, pair.choose, on_done=pair.done, text=True)
            pair.join()
            fleet.stop_all([e.proc for e in engines])
            click.echo("the same slice to fresh engines in turn (round-robin) ...", err=True)
            fresh = fleet.start_engines(n_engines, scale, speed)
            stack.callback(fleet.stop_all, [e.proc for e in fresh])
            rr = fleet.replay(reqs, scale, lambda i: fresh[i % n_engines].url, text=True)
            _report(kv, rr, pair, source, speed, load, n_engines, policy)
    finally:
        if keep:
            click.echo(f"working directory kept: {work}", err=True)
        else:
            shutil.rmtree(work, ignore_errors=True)


def _report(kv: fleet.Summary, rr: fleet.Summary, pair: _TwoReplicas, source: str, speed: float, load: float,
            engines: int,
            policy: str) -> None:
    kv_rows = [(f"kvstream {policy} (2 replicas)", kv), ("round-robin", rr)]
    click.echo("")
    click.echo(f"{'routing':<26} {'requests':>8} {'failed':>6} {'TTFT p50':>9} {'TTFT p99':>9} {'cached-token share':>19}")
    for name, s in kv_rows:
        click.echo(f"{name:<26} {s.requests:>8} {s.failed:>6} {s.ttft_p50_ms:>7.0f}ms {s.ttft_p99_ms:>7.0f}ms "
                   f"{s.cached_token_share:>19.1%}")
    click.echo(f"({engines} engines at {speed:g}x real time, the trace at {load:g}x its load; TTFT in wall-clock ms at that speed; cached tokens are "
               f"the engines' own usage.prompt_tokens_details; trace: {source}; load {fleet.loadavg()})")
    if pair.restart_s is not None:
        click.echo(f"replica B killed with SIGKILL mid-run and restarted from its snapshot "
                   f"({pair.restored_blocks:.0f} blocks restored): ready in {pair.restart_s:.2f} s")
    else:
        click.echo("replica B was not restarted (it never drained)")
    for name, s in kv_rows:
        if s.failed:
            click.echo(f"{name}: {s.failed} requests failed: {'; '.join(s.errors)}")
    if kv.failed or rr.failed or pair.restart_s is None:
        raise click.ClickException("the demo did not run cleanly (see above)")
