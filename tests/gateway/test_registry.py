"""The registered workers as the gateway sees them (kvstream.gateway.static): a
registration's endpoint, and the directory following the replica's fold of
``kvstream.workers`` (kvstream.replica.registry) record by record."""

from __future__ import annotations

from kvstream.events.registration import Registration, RegistrationCodec
from kvstream.events.wire import worker_key
from kvstream.gateway.static import RegisteredDirectory, endpoint_of
from kvstream.replica.registry import WorkerRegistry
from tests.events.strategies import registration

CODEC = RegistrationCodec()


def test_endpoint_of_a_registration() -> None:
    reg = Registration(5, "http://127.0.0.1:8000/", ("m",), ("a",), 16, (2, 3), "vllm", 100, 9, 1)
    ep = endpoint_of(reg)
    assert ep is not None and ep.url == "http://127.0.0.1:8000"  # trailing slash dropped
    assert (ep.worker_id, ep.models, ep.loras, ep.dp_ranks, ep.kv_capacity_blocks) == (5, ("m",), ("a",), 2, 100)
    assert ep.serves("m") and ep.serves("a") and not ep.serves("b")
    assert endpoint_of(Registration(5, None, (), (), 16, (0,), "synthetic", None, 9, 1)) is None


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
