"""The compose fleet of docker/compose.yaml, as an operator starts it: Kafka, the topics,
two routers and one synthetic worker. Both routers become ready, route a prompt that the
worker stored to that worker, and agree; the API wants the token; a router without a
token is not reachable from outside its container."""

from __future__ import annotations

import os
import secrets
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from kvstream.tools.procs import free_port

pytestmark = pytest.mark.docker

COMPOSE_FILE = Path(__file__).resolve().parents[2] / "docker" / "compose.yaml"
#: Bring-up of the fleet and each wait below; generous for a busy 2-core machine.
DEADLINE_S = 300


@dataclass(frozen=True)
class Fleet:
    #: worker-1's container id.
    worker: str
    project: str
    token: str
    routers: tuple[str, str]


def eventually(check: Callable[[], object], what: str, deadline_s: float = DEADLINE_S) -> object:
    """The first truthy result of ``check``, retried until the deadline; the last error or
    value explains a failure."""
    end = time.monotonic() + deadline_s
    last: object = None
    while time.monotonic() < end:
        try:
            if result := check():
                return result
            last = result
        except (httpx.HTTPError, AssertionError) as exc:
            last = exc
        time.sleep(1)
    raise AssertionError(f"{what}: not within {deadline_s} s (last: {last!r})")


@pytest.fixture(scope="module")
def fleet(images, compose_cli) -> Iterator[Fleet]:
    project = f"kvstream-smoke-{uuid.uuid4().hex[:8]}"
    token = secrets.token_urlsafe(16)
    ports = [free_port() for _ in range(3)]
    env = {
        "KVSTREAM_TOKEN": token,
        "KVSTREAM_ROUTER1_PORT": str(ports[0]),
        "KVSTREAM_ROUTER2_PORT": str(ports[1]),
        "KVSTREAM_KAFKA_PORT": str(ports[2]),
    }
    cmd = [*compose_cli, "-f", str(COMPOSE_FILE), "-p", project]
    run_env = {**os.environ, **env}

    def compose(*args: str, timeout: float = DEADLINE_S) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*cmd, *args], env=run_env, capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)

    try:
        up = compose("up", "-d", "kafka", "topics", "router-1", "router-2", "worker-1")
        assert up.returncode == 0, f"compose up failed:\n{up.stdout}\n{up.stderr}"
        worker = compose("ps", "-q", "worker-1").stdout.strip()
        yield Fleet(worker, project, token, (f"http://127.0.0.1:{ports[0]}", f"http://127.0.0.1:{ports[1]}"))
    except BaseException:
        print(compose("logs", "--tail", "60", timeout=60).stdout)
        raise
    finally:
        compose("down", "-v", "--remove-orphans", timeout=180)


def test_routers_route_the_workers_prompt_and_agree(fleet, docker_cli):
    from kvstream.worker.synthetic import PromptSetOptions, shared_prefix_prompts

    auth = {"Authorization": f"Bearer {fleet.token}"}
    for base in fleet.routers:
        eventually(lambda base=base: httpx.get(f"{base}/readyz", timeout=5).status_code == 200, f"{base}/readyz")
    # worker-1 runs the synthetic workload of seed 0; its first prompt, whose shared prefix
    # the later prompts keep hot.
    prompt = next(shared_prefix_prompts(PromptSetOptions(prompts=1, seed=0)))
    body = {"token_ids": prompt, "query_only": True}

    def decisions() -> list[dict] | None:
        answers = []
        for base in fleet.routers:
            r = httpx.post(f"{base}/v1/route", json=body, headers=auth, timeout=10)
            assert r.status_code == 200, r.text
            answers.append(r.json())
        stored = all(a["worker_id"] == 1 and a["overlap"]["device"] > 0 for a in answers)
        same = answers[0]["worker_id"] == answers[1]["worker_id"] and answers[0]["overlap"] == answers[1]["overlap"]
        return answers if stored and same else None

    answers = eventually(decisions, "both routers route the stored prompt to worker 1 alike")
    # The worker's own health check (its metrics endpoint) comes after its first interval.
    eventually(
        lambda: docker_cli("inspect", "-f", "{{.State.Health.Status}}", fleet.worker).stdout.strip() == "healthy",
        "worker-1's health check",
    )
    assert answers[0]["cached_tokens"] == answers[1]["cached_tokens"] > 0

    # The API wants the token; /readyz (the health check) does not.
    for base in fleet.routers:
        assert httpx.post(f"{base}/v1/route", json=body, timeout=10).status_code == 401


def test_a_router_without_a_token_stays_on_its_loopback(fleet, images, docker_cli):
    """Same image and network, no KVSTREAM_REPLICA__TOKEN: healthy inside, unreachable outside."""
    name = f"{fleet.project}-untokened"
    networks = docker_cli("network", "ls", "-q", "--filter", f"name={fleet.project}").stdout.split()
    assert len(networks) == 1, networks
    docker_cli("run", "-d", "--name", name, "--network", networks[0], "-e", "KVSTREAM_BOOTSTRAP=kafka:9092",
               "-p", "127.0.0.1::8470", images["router"], "router")
    try:
        eventually(
            lambda: docker_cli("inspect", "-f", "{{.State.Health.Status}}", name).stdout.strip() == "healthy",
            "the token-less router's health check",
        )
        port = int(docker_cli("port", name, "8470/tcp").stdout.split(":")[-1])
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=5)
        assert "listens on the container's loopback only" in docker_cli("logs", name).stderr
    finally:
        docker_cli("rm", "-f", "-v", name, check=False)
