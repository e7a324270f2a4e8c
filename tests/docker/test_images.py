"""kvstream's images as built: non-root, health-checked, and the router image (no torch)
runs its commands."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.docker


@pytest.mark.parametrize("role", ["kafka", "router", "worker"])
def test_images_run_as_non_root_with_a_health_check(images, docker_cli, role):
    image = images[role]
    config = json.loads(docker_cli("image", "inspect", "-f", "{{json .Config}}", image).stdout)
    assert config["User"] not in ("", "root", "0"), f"{image} runs as root"
    assert config["Healthcheck"] and config["Healthcheck"]["Test"][0] == "CMD", f"{image} has no health check"
    # The process really runs as that user.
    assert docker_cli("run", "--rm", "--entrypoint", "id", image, "-u").stdout.strip() == config["User"]


def test_router_image_has_no_torch_and_says_what_needs_it(images, docker_cli):
    listing = docker_cli("run", "--rm", images["router"], "--help").stdout
    assert "router" in listing and "topics" in listing
    proc = docker_cli("run", "--rm", images["router"], "simulate", check=False)
    assert proc.returncode == 1
    assert "needs the Python package 'torch'" in proc.stderr


def test_router_image_has_the_rust_kernel(images, docker_cli):
    docker_cli("run", "--rm", "--entrypoint", "python3", images["router"], "-c", "import kvstream._native")
