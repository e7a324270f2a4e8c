"""The registered workers as the gateway sees them (kvstream.gateway.static): a
registration's endpoint, the directory following the replica's fold of
``kvstream.workers`` (kvstream.replica.registry) record by record, and the static
workers' roles."""

from __future__ import annotations

from typing import Any

import pytest

from kvstream.events.registration import Registration, RegistrationCodec
from kvstream.events.wire import worker_key
from kvstream.gateway.errors import OptionsError
from kvstream.gateway.options import StaticWorker
from kvstream.gateway.static import RegisteredDirectory, StaticDirectory, endpoint_of
from kvstream.replica.registry import WorkerRegistry
from kvstream.roles import Handoff, Role
from tests.events.strategies import registration

CODEC = RegistrationCodec()


def test_endpoint_of_a_registration() -> None:
    reg = Registration(5, "http://127.0.0.1:8000/", ("m",), ("a",), 16, (2, 3), "vllm", 100, 9, 1)
    ep = endpoint_of(reg)
    assert ep is not None and ep.url == "http://127.0.0.1:8000"  # trailing slash dropped
    assert (ep.worker_id, ep.models, ep.loras, ep.dp_ranks, ep.kv_capacity_blocks) == (5, ("m",), ("a",), 2, 100)
    assert ep.serves("m") and ep.serves("a") and not ep.serves("b")
    assert endpoint_of(Registration(5, None, (), (), 16, (0,), "synthetic", None, 9, 1)) is None
    assert (ep.role, ep.handoff, ep.bootstrap_port) == (Role.BOTH, None, None)
    prefill = Registration(5, "http://h:1", ("m",), (), 16, (0,), "sglang", None, 9, 1, role=Role.PREFILL,
                           handoff=Handoff.BOOTSTRAP, bootstrap_port=8998)
    ep = endpoint_of(prefill)
    assert ep is not None and (ep.role, ep.handoff, ep.bootstrap_port) == (Role.PREFILL, Handoff.BOOTSTRAP, 8998)


def test_the_directory_follows_the_registry() -> None:
    registry = WorkerRegistry()
    directory = RegisteredDirectory(registry)
    assert directory.endpoints() == () and directory.endpoint(1) is None
    for wid in (3, 1):
        assert registry.apply(worker_key(wid), CODEC.encode(registration(wid))) is None
    # A worker with no engine URL is registered but not routable.
    unroutable = Registration(2, None, (), (), 16, (0,), "synthetic", None, 1, 0)
    assert registry.apply(worker_key(2), CODEC.encode(unroutable)) is None
    eps = directory.endpoints()
    assert [ep.worker_id for ep in eps] == [1, 3] and directory.endpoint(2) is None
    assert directory.endpoints() is eps  # the same sequence while nothing changed
    assert registry.apply(worker_key(1), None) is None
    assert [ep.worker_id for ep in directory.endpoints()] == [3] and directory.endpoint(1) is None
    assert directory.endpoint(3) == endpoint_of(registry.registrations()[3])


def test_static_workers_declare_their_role() -> None:
    directory = StaticDirectory([
        StaticWorker(3, "http://h:3", ("m",), role="decode", handoff="bootstrap"),
        StaticWorker(1, "http://h:1", ("m",)),
        StaticWorker(2, "http://h:2", ("m",), role="prefill", handoff="bootstrap", bootstrap_port=8998),
    ])
    assert [(ep.worker_id, ep.role, ep.handoff, ep.bootstrap_port) for ep in directory.endpoints()] == [
        (1, Role.BOTH, None, None), (2, Role.PREFILL, Handoff.BOOTSTRAP, 8998), (3, Role.DECODE, Handoff.BOOTSTRAP, None)]


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"role": "prefill"}, "worker 4: role prefill needs a handoff"),
        ({"handoff": "nixl"}, "worker 4: role both takes no handoff"),
        ({"role": "prefill", "handoff": "bootstrap"}, "worker 4: a prefill worker of handoff bootstrap needs its bootstrap_port"),
        ({"role": "decode", "handoff": "nixl", "bootstrap_port": 1}, "worker 4: bootstrap_port goes only with handoff bootstrap"),
        ({"role": "prefill", "handoff": "bootstrap", "bootstrap_port": 0}, "worker 4: bootstrap_port 0 is not in"),
    ],
)
def test_a_static_worker_keeps_the_rules_of_registered_ones(fields: dict[str, Any], match: str) -> None:
    with pytest.raises(OptionsError, match=match):
        StaticDirectory([StaticWorker(4, "http://h:4", ("m",), **fields)])
