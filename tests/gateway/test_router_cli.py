"""``kvstream router`` builds its gateway from the settings: ``[[gateway.workers]]`` in
the TOML, ``[gateway]`` options, ``KVSTREAM_GATEWAY__*`` and ``--no-gateway``."""

from __future__ import annotations

import subprocess
from pathlib import Path

import httpx
import openai
import pytest

from kvstream.settings import Settings, SettingsError, load_settings
from kvstream.tools.procs import free_port

from tests.faults.helpers import (
    KVSTREAM,
    ROOT,
    router_env,
    stop_process,
    wait_http,
)
from tests.gateway.backends import Backend, running

pytestmark = pytest.mark.kafka


def _toml(tmp_path: Path, url: str) -> Path:
    path = tmp_path / "kvstream.toml"
    path.write_text(
        "[gateway]\nretries = 1\n\n"
        f'[[gateway.workers]]\nid = 7\nurl = "{url}"\nmodels = ["m"]\napi_key = "worker-key"\n'
    )
    return path


def test_router_serves_the_openai_api_for_the_workers_of_its_toml(kafka_topics: Settings, tmp_path: Path) -> None:
    with running(Backend("a", chunks=3)) as (a,):
        config = _toml(tmp_path, a.url)
        port = free_port()
        env = router_env(kafka_topics) | {"KVSTREAM_REPLICA__CLIENT_TOKEN": "client-token", "KVSTREAM_LOG_LEVEL": "INFO"}
        with open(tmp_path / "router.log", "ab") as out:
            proc = subprocess.Popen(
                [str(KVSTREAM), "router", "--config", str(config), "--bootstrap", str(kafka_topics.bootstrap), "--port", str(port)],
                env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT,
            )
        try:
            wait_http(f"http://127.0.0.1:{port}/readyz", 60, proc)
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="client-token", max_retries=0)
            assert [m.id for m in client.models.list()] == ["m"]
            r = client.completions.with_raw_response.create(model="m", prompt=[1, 2, 3], stream=True)
            assert r.headers["x-kvstream-worker"] == "7"
            assert "".join(c.choices[0].text for c in r.parse()) == "t0 t1 t2 "
            assert a.requests()[-1].headers["authorization"] == "Bearer worker-key"
            assert 'kvstream_gateway_requests_total{endpoint="/v1/completions",model="m",status="200"} 1.0' in \
                httpx.get(f"http://127.0.0.1:{port}/metrics").text
        finally:
            stop_process(proc)
        assert "gateway request" in (tmp_path / "router.log").read_text()  # the request's log line


def test_gateway_settings_come_from_toml_env_and_are_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = _toml(tmp_path, "http://127.0.0.1:9")
    monkeypatch.setenv("KVSTREAM_GATEWAY__BREAKER_FAILURES", "9")
    g = load_settings(config).gateway
    assert (g.retries, g.breaker_failures, g.enabled) == (1, 9, True)
    assert [(w.id, w.url, w.models, w.api_key) for w in g.workers] == [(7, "http://127.0.0.1:9", ("m",), "worker-key")]
    assert "worker-key" not in repr(g)
    bad = {
        "[gateway]\nretries = -1\n": "retries must be >= 0",
        "[gateway]\nsurprise = 1\n": "surprise",
        "[gateway]\ntokenize = \"remote\"\n": "tokenize",
        '[[gateway.workers]]\nid = 1\nurl = "http://h:1/v1"\nmodels = ["m"]\n': "without /v1",
        '[[gateway.workers]]\nid = 1\nurl = "h:1"\nmodels = ["m"]\n': "http(s)://",
        '[[gateway.workers]]\nid = 1\nurl = "http://h:1"\nmodels = []\n': "at least one model",
        '[[gateway.workers]]\nid = 1\nurl = "http://h:1"\nmodels = ["m"]\n[[gateway.workers]]\nid = 1\nurl = "http://h:2"\nmodels = ["m"]\n':
            "names a worker id twice",
        '[[gateway.workers]]\nid = 1\nurl = "http://h:1"\nmodels = ["m"]\nrole = "prefil"\n':
            "worker 1: role must be one of both, prefill, decode, got 'prefil'",
        '[[gateway.workers]]\nid = 1\nurl = "http://h:1"\nmodels = ["m"]\nrole = "decode"\nhandoff = "rdma"\n':
            "worker 1: handoff must be one of nixl, bootstrap, got 'rdma'",
    }
    monkeypatch.delenv("KVSTREAM_GATEWAY__BREAKER_FAILURES")
    for text, why in bad.items():
        (tmp_path / "bad.toml").write_text(text)
        with pytest.raises(SettingsError, match=why.replace("(", r"\(").replace(")", r"\)")):
            load_settings(tmp_path / "bad.toml")


def test_no_gateway_flag_leaves_the_openai_endpoints_out(kafka_topics: Settings, tmp_path: Path) -> None:
    port = free_port()
    with open(tmp_path / "router.log", "ab") as out:
        proc = subprocess.Popen(
            [str(KVSTREAM), "router", "--no-gateway", "--bootstrap", str(kafka_topics.bootstrap), "--port", str(port)],
            env=router_env(kafka_topics), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT,
        )
    try:
        wait_http(f"http://127.0.0.1:{port}/readyz", 60, proc)
        assert httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"model": "m", "prompt": [1]}).status_code == 404
        assert httpx.post(f"http://127.0.0.1:{port}/v1/route", json={"token_ids": [1], "query_only": True}).status_code == 503
    finally:
        stop_process(proc)


def test_a_gateway_that_cannot_start_stops_the_router(kafka_topics: Settings, tmp_path: Path) -> None:
    # The replica starts before the gateway loads its tokenizers (a restart catches up
    # meanwhile): a tokenizer that cannot be loaded stops it again, and the command fails.
    config = tmp_path / "kvstream.toml"
    config.write_text(f'[[gateway.models]]\nname = "m"\ntokenizer = "{tmp_path / "missing"}"\n')
    snapshots = tmp_path / "snapshots"
    out = subprocess.run(
        [str(KVSTREAM), "router", "--config", str(config), "--bootstrap", str(kafka_topics.bootstrap),
         "--port", str(free_port()), "--snapshot-dir", str(snapshots)],
        env=router_env(kafka_topics), capture_output=True, text=True, stdin=subprocess.DEVNULL, cwd=ROOT, timeout=60,
    )
    assert out.returncode == 1, out.stderr
    assert "Error: cannot start the gateway:" in out.stderr
    assert "stopped without a final snapshot" not in out.stderr
