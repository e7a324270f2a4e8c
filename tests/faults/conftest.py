"""A three-broker local KRaft cluster for the broker-fault tests (replication factor 3,
``min.insync.replicas=2``), started once per module that asks for it and always
stopped; ``owner_pid`` makes it stop by itself should this session be killed."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest

from kvstream.kafka.local_broker import LocalCluster, start_local_cluster, stop_local_cluster


@pytest.fixture(scope="module")
def three_brokers() -> Iterator[LocalCluster]:
    path = tempfile.mkdtemp(prefix="kvstream-faults-")
    try:
        cluster = start_local_cluster(3, path, owner_pid=os.getpid())
        yield cluster
    finally:
        stop_local_cluster(path)
        shutil.rmtree(path, ignore_errors=True)
