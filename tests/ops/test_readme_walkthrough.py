"""The README's walkthrough is a test (issue 26): the block between its
``<!-- walkthrough`` and ``<!-- /walkthrough -->`` markers runs as a bash script, on free
ports and a broker folder of its own, and what it prints must show the point of the
product: the second of two identical prompts is a cache hit (the router's prediction and
the engine's own count), on the worker that /v1/workers says holds the blocks, which is
the worker /v1/route explains it would choose. It must also leave nothing running. Its
disaggregated variant (``<!-- pd-walkthrough``) shows the same on the prefill side."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from kvstream.tools.procs import free_port_run

ROOT = Path(__file__).resolve().parents[2]
ANSWER = re.compile(
    r"^(first|second): worker (\d+), router predicted (\d+) cached tokens, engine cached (\d+) of (\d+)$", re.MULTILINE
)


PD_ANSWER = re.compile(
    r"^(first|second): prefill worker (\d+), decode worker (\d+), router predicted (\d+) cached tokens, "
    r"prefill engine's cache hits so far (\d+), (\d+) tokens out$", re.MULTILINE
)


def walkthrough(marker: str = "walkthrough") -> str:
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(rf"<!-- {marker}\b[^>]*-->\n```bash\n(.*?)```\n<!-- /{marker} -->", text, re.DOTALL)
    assert len(blocks) == 1, f"the README must mark exactly one {marker} block"
    return blocks[0]


def section(out: str, name: str) -> dict:
    start = out.index(f"== {name}\n") + len(f"== {name}\n")
    return json.JSONDecoder().raw_decode(out[start:])[0]


def run_block(marker: str, tmp_path: Path) -> tuple[str, list[int]]:
    """The block run as a bash script on free ports: what it printed (it must succeed),
    and its ports (router, engine, kv, replay)."""
    base = free_port_run(16)  # each with room above it (the engine's DP ranks)
    ports = [base, base + 4, base + 8, base + 12]
    router, engine, kv, replay = ports
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "ROUTER_PORT": str(router), "ENGINE_PORT": str(engine), "KV_PORT": str(kv), "REPLAY_PORT": str(replay),
        "TMPDIR": str(tmp_path),
    }
    for name in [k for k in env if k.startswith("KVSTREAM_")]:
        del env[name]  # the walkthrough's own settings only
    script = tmp_path / f"{marker}.sh"
    script.write_text(walkthrough(marker))
    proc = subprocess.run(
        ["bash", str(script)], check=False, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, timeout=540,
    )
    assert proc.returncode == 0, proc.stdout
    return proc.stdout, ports


def assert_cleaned_up(out: str, tmp_path: Path, ports: Sequence[int]) -> None:
    """The broker is stopped, its folder gone, nothing listens on the ports
    (SO_REUSEADDR: connections the servers closed may linger in TIME_WAIT, harmlessly)."""
    assert "stopped; the next `kvstream broker start` wipes" in out
    assert not any(tmp_path.glob("tmp.*")), list(tmp_path.iterdir())
    for port in ports:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_readme_walkthrough_shows_a_cache_hit(tmp_path):
    pytest.importorskip("openai")
    out, (router, engine, kv, replay) = run_block("walkthrough", tmp_path)
    answers = {m[0]: tuple(int(x) for x in m[1:]) for m in ANSWER.findall(out)}
    assert set(answers) == {"first", "second"}, out
    first, second = answers["first"], answers["second"]
    # The first is computed; the second goes to the same worker and hits its cache:
    # predicted by the router and counted by the engine itself, a whole-block prefix.
    assert first[1] == first[2] == 0, out
    assert second[0] == first[0], out
    assert second[2] > 0 and second[2] % 16 == 0, out
    assert second[1] == second[2], out
    assert second[3] - second[2] < 16, out
    holder = second[0]
    indexed = re.search(r"^the router indexed its blocks (\d+) ms after the answer$", out, re.MULTILINE)
    assert indexed and int(indexed[1]) < 30_000, out

    workers = section(out, "/v1/workers")["workers"]
    assert set(workers) == {"1", "2"}, workers
    held = workers[str(holder)]
    assert held["ranks"]["0"]["device"] >= second[2] // 16, held
    assert held["registration"]["routable"] and held["registration"]["url"].endswith(f":{engine + holder}")
    assert held["registration"]["models"] == ["demo-model"]
    other = workers[str(3 - holder)]
    assert other["ranks"].get("0", {}).get("device", 0) == 0, other

    route = section(out, "/v1/route")
    assert route["worker_id"] == holder
    assert route["overlap"]["device"] == second[2] // 16
    assert route["cached_tokens"] == second[2]
    by_worker = {c["worker_id"]: c["overlap"]["device"] for c in route["candidates"]}
    assert by_worker == {holder: second[2] // 16, 3 - holder: 0}, route["candidates"]

    assert_cleaned_up(out, tmp_path, (router, engine + 1, engine + 2, kv + 1, kv + 2, replay + 1, replay + 2))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_disaggregated_walkthrough_hits_the_prefill_engines_cache(tmp_path):
    pytest.importorskip("openai")
    out, (router, engine, kv, replay) = run_block("pd-walkthrough", tmp_path)
    answers = {m[0]: tuple(int(x) for x in m[1:]) for m in PD_ANSWER.findall(out)}
    assert set(answers) == {"first", "second"}, out
    (p1, d1, predicted1, hits1, out1), (p2, d2, predicted2, hits2, out2) = answers["first"], answers["second"]
    # Each request in two legs: prefill on engine 1 or 2, decode on engine 3, the answer whole.
    assert p1 in (1, 2) and d1 == d2 == 3 and out1 == out2 == 8, out
    # The second prefill goes where the first was computed, predicted by the router and
    # counted by that engine itself: a whole-block prefix.
    assert p2 == p1, out
    assert predicted1 == hits1 == 0, out
    assert predicted2 > 0 and predicted2 % 16 == 0 and hits2 - hits1 == predicted2, out
    assert_cleaned_up(out, tmp_path, (router, *(p + i for p in (engine, kv, replay) for i in (1, 2, 3))))
