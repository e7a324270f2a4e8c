"""``KVSTREAM_TEST_KAFKA`` (tests/conftest.py): each source is taken when asked for, auto
falls back to the local broker when Docker cannot serve, and the session says which and
why. Each case runs one real Kafka test in a pytest of its own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROBE = "tests/kafka/test_broker.py::test_the_broker_answers"


def session(**env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("KVSTREAM_TEST_KAFKA", "KVSTREAM_BOOTSTRAP")}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", PROBE],
        cwd=ROOT, env={**clean, **env}, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL,
    )


def test_auto_without_an_engine_takes_the_local_broker_and_says_why():
    proc = session(DOCKER_HOST="unix:///nonexistent/docker.sock")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "kafka_bootstrap: local (no Docker engine answers at unix:///nonexistent/docker.sock)" in proc.stdout


@pytest.mark.parametrize(
    "env,message",
    [
        ({"KVSTREAM_TEST_KAFKA": "kubernetes"}, "KVSTREAM_TEST_KAFKA='kubernetes': expected one of auto, external, docker, local"),
        ({"KVSTREAM_TEST_KAFKA": "external"}, "KVSTREAM_TEST_KAFKA=external needs KVSTREAM_BOOTSTRAP"),
        (
            {"KVSTREAM_TEST_KAFKA": "docker", "DOCKER_HOST": "unix:///nonexistent/docker.sock"},
            "KVSTREAM_TEST_KAFKA=docker, but no Docker engine answers at unix:///nonexistent/docker.sock",
        ),
    ],
)
def test_a_source_that_cannot_be_had_is_an_error_with_the_reason(env, message):
    proc = session(**env)
    assert proc.returncode != 0
    assert message in proc.stdout + proc.stderr


@pytest.mark.docker
def test_auto_with_an_engine_but_no_image_takes_the_local_broker(images):
    proc = session(KVSTREAM_TEST_KAFKA_IMAGE="kvstream-kafka:no-such-version")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "kafka_bootstrap: local (a Docker engine answers at" in proc.stdout
    assert "kvstream-kafka:no-such-version is neither present nor pullable" in proc.stdout


@pytest.mark.docker
def test_auto_with_an_engine_and_the_image_takes_docker(images):
    proc = session()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"kafka_bootstrap: docker (a Docker engine answers and {images['kafka']} is there)" in proc.stdout
