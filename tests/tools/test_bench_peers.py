"""The peer routers (sglang-router, vllm-router: pinned PyPI wheels installed into their
own cached venv on first use) in front of kvstream's bench backend, driven by the
official ``openai`` client; and ``kvstream bench gateway`` at a tiny size.

First use installs the peers (about a minute) and builds oha (minutes): slow."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import click
import httpx
import openai
import pytest
from click.testing import CliRunner

from kvstream.settings import Settings
from bench import bench
from bench.backend import MODEL, backend_requests, start_backends
from bench.peers import PeerOptions, peer_command, start_peer
from kvstream.tools.procs import free_port, port_taken

pytestmark = [pytest.mark.slow]

#: kvstream's streams per second over sglang-router's at the kvstream front test's size
#: (16 connections, 64 events), below which it fails: issue 22's target. 4.3-4.8 measured
#: on the shared 2-core machine (0.50 before the eighth session's changes; sglang-router's
#: streams at 16 connections wait on the load generator's delayed ACKs).
STREAM_RATIO_FLOOR = 1.0

CASES = [
    ("sglang-router", "cache_aware"),
    ("sglang-router", "round_robin"),
    ("vllm-router", "cache_aware"),
    ("vllm-router", "round_robin"),
    ("vllm-router", "kv_aware"),
]


def _served(urls: list[str], path: str) -> list[int]:
    with httpx.Client() as client:
        return [backend_requests(u, path, client) for u in urls]


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.timeout(900)
@pytest.mark.parametrize(("peer", "policy"), CASES, ids=[f"{p}-{q}" for p, q in CASES])
def test_peer_relays_requests_to_a_backend(peer: str, policy: str) -> None:
    with start_backends(2, tokens=8) as backends:
        urls = [b.url for b in backends]
        # kv_aware subscribes to each worker's vLLM ZMQ publisher; none publishes here,
        # so it routes without events.
        kv = {u: f"tcp://127.0.0.1:{free_port()}" for u in urls} if policy == "kv_aware" else None
        options = PeerOptions(peer, policy, tuple(urls), kv_events=kv, kv_event_model=MODEL if kv else None)
        with start_peer(options) as proc:
            pgid = proc.popen.pid
            before = _served(urls, "/v1/completions")
            client = openai.OpenAI(base_url=proc.url + "/v1", api_key="unused", max_retries=0)
            done = client.completions.create(model=MODEL, prompt="the shared prefix of a fleet", max_tokens=5)
            # The backend's own answer, relayed: its id names the backend's port.
            port = int(done.id.split("-")[1])
            assert f"http://127.0.0.1:{port}" in urls
            assert done.choices[0].text == " a" * 5
            assert done.usage.prompt_tokens == len(b"the shared prefix of a fleet")
            after = _served(urls, "/v1/completions")
            assert sum(after) - sum(before) == 1
            assert after[urls.index(f"http://127.0.0.1:{port}")] - before[urls.index(f"http://127.0.0.1:{port}")] == 1

            chunks = list(client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True,
            ))
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == " a" * 4
            assert chunks[-1].choices[0].finish_reason == "length"
            assert sum(_served(urls, "/v1/chat/completions")) == 1
            renders = _served(urls, "/v1/completions/render")
            if peer == "vllm-router" and policy != "round_robin":
                # vllm-router's prefix policies have every worker render the prompt.
                assert all(n >= 1 for n in renders)
            else:
                assert renders == [0, 0]
            assert proc.cpu_seconds() > 0
        assert proc.popen.poll() is not None
        assert not _group_alive(pgid)


@pytest.mark.timeout(900)
def test_vllm_router_kv_aware_follows_vllms_own_kv_events() -> None:
    """vllm-router ``kv_aware`` fed by vLLM's own ZmqEventPublisher (the pinned wheel):
    a prompt goes to the worker whose events say it holds the prompt's blocks (the ids
    of its ``/v1/completions/render``: the backend's byte tokens)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the engines' kit
    from engines.engines import kit

    vllm = kit("vllm")
    with start_backends(3, tokens=1) as backends:
        urls = [b.url for b in backends]
        ports = [free_port() for _ in urls]
        publishers = [vllm.publisher(0, p, None) for p in ports]
        try:
            kv = {u: f"tcp://127.0.0.1:{p}" for u, p in zip(urls, ports)}
            options = PeerOptions("vllm-router", "kv_aware", tuple(urls), kv_events=kv, kv_event_model=MODEL)
            with start_peer(options) as proc, httpx.Client(base_url=proc.url, timeout=10) as client:
                for holder in (2, 0, 1):
                    prompt = (f"held by worker {holder}; " * 20)[:8 * 16]
                    ids = list(prompt.encode())
                    hashes = [(holder + 1) * 1000 + i for i in range(len(ids) // 16)]

                    def routed(prompt: str = prompt) -> int:
                        r = client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1})
                        return urls.index(f"http://127.0.0.1:{r.json()['id'].split('-')[1]}")

                    # PUB/SUB drops what is sent before the subscriber joined: publish
                    # until the router shows it has the blocks.
                    deadline = time.monotonic() + 30
                    while True:
                        publishers[holder].publish(vllm.batch([vllm.stored(hashes, None, ids, 16)]))
                        time.sleep(0.3)
                        if routed() == holder or time.monotonic() > deadline:
                            break
                    assert [routed() for _ in range(4)] == [holder] * 4
        finally:
            for pub in publishers:
                pub.shutdown()


def test_a_taken_port_is_refused() -> None:
    with start_backends(1, tokens=1) as backends:
        taken = backends[0].port
        assert port_taken(taken)
        options = PeerOptions("sglang-router", "cache_aware", (backends[0].url,))
        with pytest.raises(click.ClickException, match=f"port {taken} .* is taken"), start_peer(options, port=taken):
            pass


def test_bad_peer_options_are_refused() -> None:
    with pytest.raises(click.ClickException, match="policy"):
        PeerOptions("sglang-router", "kv_aware", ("http://127.0.0.1:1",))
    with pytest.raises(click.ClickException, match="ZMQ event endpoint"):
        PeerOptions("vllm-router", "kv_aware", ("http://127.0.0.1:1",))


def _values(cmd: list[str], flag: str) -> list[list[str]]:
    """The arguments after each ``flag`` of ``cmd``, up to the next option."""
    out = []
    for i, arg in enumerate(cmd):
        if arg == flag:
            rest = cmd[i + 1:]
            out.append(rest[: next((j for j, a in enumerate(rest) if a.startswith("--")), len(rest))])
    return out


def test_pd_command_lines() -> None:
    """PD mode: the prefill workers (with their bootstrap ports where given) and the decode
    workers, each peer's own PD switch and hand-off; kv_aware reads the prefill workers'
    events only. Without decode workers the command is the plain one."""
    venv, p, d = Path("/venv"), ("http://127.0.0.1:1", "http://127.0.0.1:2"), ("http://127.0.0.1:3",)
    sglang = peer_command(PeerOptions("sglang-router", "cache_aware", p, decode=d,
                                      bootstrap_ports={p[0]: 9001, p[1]: 9002}), venv, 10, 11)
    assert sglang[:3] == ["/venv/bin/sglang-router", "launch", "--pd-disaggregation"]
    assert _values(sglang, "--prefill") == [[p[0], "9001"], [p[1], "9002"]] and _values(sglang, "--decode") == [[d[0]]]
    assert _values(sglang, "--policy") == [["cache_aware"]] and "--worker-urls" not in sglang

    events = {p[0]: "tcp://127.0.0.1:5001", p[1]: "tcp://127.0.0.1:5002"}
    for policy in ("cache_aware", "kv_aware"):
        kv = policy == "kv_aware"
        vllm = peer_command(PeerOptions("vllm-router", policy, p, events if kv else None, MODEL if kv else None,
                                        decode=d), venv, 10, 11)
        assert vllm[0] == "/venv/bin/vllm-router" and "--vllm-pd-disaggregation" in vllm
        assert _values(vllm, "--prefill") == [[p[0]], [p[1]]] and _values(vllm, "--decode") == [[d[0]]]
        assert _values(vllm, "--kv-connector") == [["nixl"]]
        assert _values(vllm, "--prefill-policy") == _values(vllm, "--decode-policy") == [[policy]]
        assert _values(vllm, "--pd-kv-events") == ([[f"{w}={events[w]}"] for w in p] if kv else [])
        assert "--kv-event-source" not in vllm and "--worker-urls" not in vllm

    plain = peer_command(PeerOptions("vllm-router", "kv_aware", p, events, MODEL), venv, 10, 11)
    assert _values(plain, "--worker-urls") == [list(p)] and len(_values(plain, "--kv-event-source")) == 2
    assert not {"--vllm-pd-disaggregation", "--prefill", "--decode", "--pd-kv-events"} & set(plain)


def test_bad_pd_options_are_refused() -> None:
    p, d = ("http://127.0.0.1:1",), ("http://127.0.0.1:2",)
    with pytest.raises(click.ClickException, match="bootstrap port"):
        PeerOptions("sglang-router", "cache_aware", p, decode=d)
    with pytest.raises(click.ClickException, match="ZMQ event endpoint"):
        PeerOptions("vllm-router", "kv_aware", p, {d[0]: "tcp://127.0.0.1:5"}, MODEL, decode=d)


def test_sigterm_stops_what_the_bench_started() -> None:
    """A bench process that is terminated still stops its servers (SIGTERM unwinds like
    Ctrl-C; their process groups are killed)."""
    script = (
        "import time\n"
        "from bench.backend import start_backends\n"
        "with start_backends(1, tokens=1) as b:\n"
        "    print(b[0].popen.pid, flush=True)\n"
        "    time.sleep(120)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        assert _group_alive(child)
        parent.send_signal(signal.SIGTERM)
        assert parent.wait(30) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 10
        while _group_alive(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _group_alive(child)
    finally:
        parent.kill()
        parent.wait()


def test_backend_answers_bad_input_in_vllms_error_format() -> None:
    with start_backends(1, tokens=1) as backends, httpx.Client(base_url=backends[0].url) as client:
        r = client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["code"] == 400
        r = client.post("/v1/completions", json={"model": "other", "prompt": "x"})
        assert r.status_code == 404 and "other" in r.json()["error"]["message"]
        r = client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": -1})
        assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
        assert client.get("/health").status_code == 200


def _bench(*args: str) -> dict:
    out = CliRunner().invoke(bench, ["gateway", "--json", *args])
    assert out.exit_code == 0, out.output
    return json.loads(out.output.strip().splitlines()[-1])


# oha is installed by the benchmark when absent: it compiles from source (minutes).
@pytest.mark.timeout(1800)
def test_gateway_bench_measures_the_peers_against_the_direct_baseline() -> None:
    r = _bench("--fronts", "direct,sglang-router,vllm-router", "--duration", "1", "--tokens", "16",
               "--prompts", "4", "--prompt-chars", "200", "--connections", "2,4", "--open-loop-connections", "8",
               "--open-loop-repeats", "2")
    for key in ("added_p50_us", "added_p99_us", "json_requests_per_s", "stream_requests_per_s",
                "sglang_router_stream_requests_per_s", "vllm_router_stream_requests_per_s"):
        assert key in r, key
    # kvstream's own keys are null when its front was not run.
    assert r["added_p50_us"] is None and r["stream_requests_per_s"] is None
    fronts = r["fronts"]
    assert list(fronts) == ["direct", "sglang-router", "vllm-router"]
    direct = fronts["direct"]
    for kind in ("json", "stream"):
        # The open loops run at half the slowest front's peak.
        slowest = min(f[f"{kind}_requests_per_s"] for f in fronts.values())
        assert direct[f"{kind}_open_loop_rate_per_s"] == round(slowest / 2) == r["open_loop_rates_per_s"][kind]
    for name in ("sglang-router", "vllm-router"):
        f = fronts[name]
        key = name.replace("-", "_") + "_"
        # Every front is driven at the same open-loop rates, and its added latency is
        # against the direct baseline of this run.
        for kind, tag in (("json", ""), ("stream", "stream_")):
            assert f[f"{kind}_open_loop_rate_per_s"] == direct[f"{kind}_open_loop_rate_per_s"]
            for q in ("p50", "p99"):
                assert f[f"added_{tag}{q}_us"] == f[f"{kind}_{q}_us"] - direct[f"{kind}_{q}_us"]
                # The median of the two open loops, each run's figure beside it.
                runs = f[f"{kind}_{q}_us_runs"]
                assert len(runs) == 2 and f[f"{kind}_{q}_us"] == round(sum(runs) / 2)
            assert f[f"{kind}_p50_us"] <= f[f"{kind}_p99_us"]
            # A front adds a hop in front of the same backend on the same cores: it
            # cannot serve clearly more than the backend alone.
            assert f[f"{kind}_requests_per_s"] <= direct[f"{kind}_requests_per_s"] / 0.8
            assert f[f"{kind}_front_cpu_us_per_request"] > 0
            # The peak is the best of the connection counts tried.
            by = f[f"{kind}_requests_per_s_by_connections"]
            assert set(by) == {"2", "4"} and f[f"{kind}_requests_per_s"] == max(by.values())
            assert by[str(f[f"{kind}_peak_connections"])] == f[f"{kind}_requests_per_s"]
        assert r[key + "stream_requests_per_s"] == f["stream_requests_per_s"]
        assert r[key + "added_p50_us"] == f["added_p50_us"]
    assert direct["json_front_cpu_us_per_request"] is None
    assert r["peer_versions"] == {"sglang-router": "0.3.2", "vllm-router": "0.1.17"}


def test_gateway_bench_kvstream_front(request: pytest.FixtureRequest) -> None:
    if "gateway" not in Settings.model_fields:
        # Until the gateway (issue 22) is in the build, its front fails with the reason.
        out = CliRunner().invoke(bench, ["gateway", "--json", "--fronts", "kvstream", "--duration", "1"])
        assert out.exit_code != 0
        assert "gateway" in out.output and "--fronts direct,sglang-router,vllm-router" in out.output
        return
    bootstrap = request.getfixturevalue("kafka_bootstrap")
    r = _bench("--fronts", "direct,kvstream,sglang-router", "--bootstrap", bootstrap, "--duration", "2",
               "--tokens", "64", "--prompts", "4", "--prompt-chars", "200", "--connections", "16",
               "--open-loop-connections", "8")
    kv, sglang = r["fronts"]["kvstream"], r["fronts"]["sglang-router"]
    assert r["added_p50_us"] == kv["json_p50_us"] - r["fronts"]["direct"]["json_p50_us"]
    assert r["stream_requests_per_s"] == kv["stream_requests_per_s"]
    assert kv["json_requests_per_s"] <= r["direct_json_requests_per_s"] / 0.8
    # Streams per second against sglang-router's, in the same run by the same load
    # generator (issue 22's target is 1.0; where the gateway stands: docs/BENCHMARKS.md).
    ratio = r["stream_ratio_vs_sglang_router"]
    assert ratio == round(kv["stream_requests_per_s"] / sglang["stream_requests_per_s"], 3)
    assert ratio >= STREAM_RATIO_FLOOR, (kv["stream_requests_per_s"], sglang["stream_requests_per_s"])
