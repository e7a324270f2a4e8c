"""``kvstream worker``: argument errors, and a real run (engine over ZMQ → Kafka) in a
subprocess, with its Prometheus metrics and a clean shutdown on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import msgpack
import pytest
import zmq
from click.testing import CliRunner

from kvstream.cli import cli
from kvstream.events.model import Cleared, Stored, Tier
from kvstream.hashing import local_hashes
from kvstream.tools.procs import free_port

from .test_publisher import read_batches

KVSTREAM = str(Path(sys.executable).with_name("kvstream"))


def test_synthetic_disk_tier_needs_a_directory():
    result = CliRunner().invoke(cli, ["worker", "--engine", "synthetic", "--worker-id", "1", "--disk-blocks", "64"])
    assert result.exit_code == 2
    assert "--disk-dir" in result.output


def test_disk_min_seen_must_be_positive():
    result = CliRunner().invoke(cli, ["worker", "--engine", "synthetic", "--worker-id", "1", "--disk-min-seen", "0"])
    assert result.exit_code == 2
    assert "--disk-min-seen" in result.output


def test_zmq_engine_needs_an_endpoint():
    result = CliRunner().invoke(cli, ["worker", "--engine", "zmq", "--worker-id", "1"])
    assert result.exit_code == 2
    assert "--endpoint" in result.output


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--engine-url", "http://127.0.0.1:8000"], "needs at least one --model"),
        (["--engine-url", "tcp://127.0.0.1:8000", "--model", "m"], "is not http(s)://host[:port]"),
        (["--engine-url", "http://h:1", "--model", " m"], "unpadded"),
    ],
)
def test_engine_url_and_models_are_checked(flags: list[str], message: str) -> None:
    result = CliRunner().invoke(cli, ["worker", "--engine", "zmq", "--endpoint", "tcp://x:1", "--worker-id", "1", *flags])
    assert result.exit_code == 2
    assert message in result.output


@pytest.mark.parametrize(
    ("flags", "env", "message"),
    [
        (["--role", "prefill"], {}, "role prefill needs a handoff (nixl or bootstrap)"),
        (["--handoff", "nixl"], {}, "role both takes no handoff"),
        (["--role", "prefill", "--handoff", "bootstrap"], {}, "needs its bootstrap_port"),
        (["--role", "decode", "--handoff", "nixl", "--bootstrap-port", "1"], {}, "only with handoff bootstrap"),
        # The settings' environment variables, under the flags.
        (["--role", "decode"], {"KVSTREAM_WORKER__HANDOFF": "bootstrap", "KVSTREAM_WORKER__BOOTSTRAP_PORT": "70000"},
         "bootstrap_port 70000 is not in 1..65535"),
        (["--role", "both"], {"KVSTREAM_WORKER__ROLE": "prefill", "KVSTREAM_WORKER__HANDOFF": "nixl"},
         "role both takes no handoff"),
    ],
)
def test_roles_are_checked_before_starting(flags: list[str], env: dict[str, str], message: str) -> None:
    result = CliRunner().invoke(
        cli, ["worker", "--engine", "zmq", "--endpoint", "tcp://x:1", "--worker-id", "1", *flags], env=env
    )
    assert result.exit_code == 2
    assert message in result.output


def test_roles_come_from_the_toml_too(tmp_path: Path) -> None:
    config = tmp_path / "k.toml"
    args = ["worker", "--engine", "zmq", "--endpoint", "tcp://x:1", "--worker-id", "1", "--config", str(config)]
    config.write_text('[worker]\nrole = "decode"\n')
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2 and "role decode needs a handoff" in result.output
    config.write_text('[worker]\nrole = "prefil"\n')
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 1 and "worker.role" in result.output


def test_worker_id_must_be_u64():
    result = CliRunner().invoke(cli, ["worker", "--engine", "zmq", "--endpoint", "tcp://x:1", "--worker-id", "-1"])
    assert result.exit_code == 2


def test_lease_must_outlast_heartbeats():
    result = CliRunner().invoke(
        cli,
        ["worker", "--engine", "zmq", "--endpoint", "tcp://x:1", "--worker-id", "1", "--lease-ms", "1000", "--heartbeat-s", "2"],
    )
    assert result.exit_code == 2
    assert "lease_ms (1000) must be longer than the heartbeat interval" in result.output


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


@pytest.mark.slow
def test_worker_bridges_an_engine_to_kafka(kafka_topics):
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.bind("tcp://127.0.0.1:*")
    endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
    metrics_port = free_port()
    # Settings from the environment as well as flags.
    env = {
        **os.environ,
        "KVSTREAM_TOPICS__PREFIX": kafka_topics.topics.prefix,
        "KVSTREAM_WORKER__METRICS_PORT": str(metrics_port),
    }
    proc = subprocess.Popen(
        [
            KVSTREAM, "worker", "--engine", "zmq", "--endpoint", endpoint, "--worker-id", "42",
            "--bootstrap", kafka_topics.bootstrap, "--metrics-addr", "127.0.0.1",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert pub.poll(60_000), "the worker never subscribed"
        pub.recv()
        tokens = list(range(48))
        payloads = [
            [1.0, [["BlockStored", [-5, 6], None, tokens[:32], 16, None, "GPU", None]], 0],
            [2.0, [["BlockStored", [7], 6, tokens[32:48], 16, None, "GPU", None], ["Bogus"]], 0],
        ]
        for seq, payload in enumerate(payloads):
            pub.send_multipart([b"", seq.to_bytes(8, "big"), msgpack.packb(payload)])
        deadline = time.monotonic() + 60
        metrics: dict[str, float] = {}
        while time.monotonic() < deadline:
            try:
                metrics = scrape(metrics_port)
            except OSError:
                metrics = {}
            if metrics.get("kvstream_worker_blocks_acked_total") == 3:
                break
            time.sleep(0.2)
        assert metrics.get("kvstream_worker_blocks_acked_total") == 3, metrics
        assert metrics['kvstream_worker_engine_issues_total{issue="unknown_tag"}'] == 1
        assert metrics["kvstream_worker_engine_messages_total"] == 2
        assert metrics["kvstream_worker_delivery_failures_total"] == 0
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        pub.close(linger=0)
        ctx.term()
    events = [ev for _, key, b in read_batches(kafka_topics) for ev in b.events]
    local = local_hashes(tokens, 16)
    epoch = events[0].epoch
    u = 1 << 64
    assert events[0] == Cleared(42, 0, Tier.DEVICE, epoch, 1)
    stored = [ev for ev in events if isinstance(ev, Stored)]
    # Linger may or may not have merged the two engine messages into one event.
    assert [h for ev in stored for h in ev.block_hashes] == [u - 5, 6, 7]
    assert [h for ev in stored for h in ev.tokens_hashes] == local
    assert stored[0].parent_hash is None


@pytest.mark.slow
def test_synthetic_worker_publishes_what_a_replica_folds(kafka_topics, tmp_path):
    pytest.importorskip("torch")
    from kvstream.events.codec import EventCodec
    from kvstream.replica.fold import LogFold
    from kvstream.router import Router

    env = {**os.environ, "KVSTREAM_TOPICS__PREFIX": kafka_topics.topics.prefix}
    proc = subprocess.run(
        [
            KVSTREAM, "worker", "--engine", "synthetic", "--worker-id", "9", "--bootstrap", kafka_topics.bootstrap,
            "--mode", "passthrough", "--prompts", "40", "--rate", "400", "--device-blocks", "64",
            "--host-blocks", "128", "--disk-blocks", "256", "--disk-dir", str(tmp_path),
        ],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout
    codec = EventCodec()
    fold = LogFold(Router(), codec)
    sizes: dict = {}
    for offset, (partition, _, batch) in enumerate(read_batches(kafka_topics)):
        out = fold.apply_record(partition, offset, 0, codec.encode(batch))
        assert out.dlq_reason is None and out.resync == ()
        for key, tiers in fold.router.tree_sizes().items():
            held = sizes.setdefault(key, {})
            for t, n in tiers.items():
                held[t.value] = max(held.get(t.value, 0), n)
    (key,) = sizes
    assert key.worker_id == 9
    # The worker withdrew its blocks when it finished (test_worker_stop.py): what it held
    # is the most each tier held while it ran.
    assert not any(fold.router.tree_sizes()[key].values())
    # 40 prompts of up to 10 blocks overflow G1 (64 blocks): blocks went down the tiers.
    assert 0 < sizes[key]["device"] <= 64
    assert sizes[key]["host_pinned"] > 0
    # ...and on to G3 (the disk filter admits a block on its first sighting by default).
    assert sizes[key]["disk"] > 0
    # It registered (with no engine URL: not routable) and withdrew when it finished.
    from kvstream.events.registration import RegistrationCodec
    from kvstream.tools.replay.reader import LogReader

    with LogReader(kafka_topics, "workers") as reader:
        records = list(reader.read(dict(reader.low), dict(reader.high)))
    assert [r.key for r in records] == [(9).to_bytes(8, "big")] * 2
    reg = RegistrationCodec().decode(records[0].value)
    assert (reg.url, reg.models, reg.engine, reg.kv_capacity_blocks) == (None, (), "synthetic", 64)
    assert records[1].value is None


def test_replay_endpoints_pair_with_endpoints():
    result = CliRunner().invoke(
        cli,
        ["worker", "--engine", "vllm", "--worker-id", "1", "--endpoint", "tcp://x:1", "--endpoint", "tcp://x:2",
         "--replay-endpoint", "tcp://x:9"],
    )
    assert result.exit_code == 2
    assert "1 --replay-endpoint for 2 --endpoint" in result.output


def test_endpoints_must_differ():
    result = CliRunner().invoke(
        cli, ["worker", "--engine", "sglang", "--worker-id", "1", "--endpoint", "tcp://x:1", "--endpoint", "tcp://x:1"]
    )
    assert result.exit_code == 2
    assert "engine endpoints repeat" in result.output
