"""Issue 9 (2): broker faults on a three-broker cluster (RF 3, min.insync.replicas=2).
One broker is killed while publishers publish and replicas consume; both carry on, and
every acknowledged event reaches every replica. Then the whole cluster is killed and
restarted: no acknowledged event is lost."""

from __future__ import annotations

import signal
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient

from kvstream.events.codec import AvroCodec
from kvstream.kafka.config import admin_config, producer_config
from kvstream.kafka.local_broker import LocalCluster, cluster_status
from kvstream.kafka.topics import ensure_topics
from kvstream.replica.replica import Replica
from kvstream.settings import Settings, TopicSettings

from tests.faults.helpers import agrees_with_log, read_log
from tests.kafka.nodes import kill_broker, restart_broker
from tests.replica.test_replica_kafka import start, wait_caught_up
from tests.replica.test_snapshot import random_log

pytestmark = [pytest.mark.faults, pytest.mark.kafka, pytest.mark.slow]


class Publisher(threading.Thread):
    """Publishes a worker log at a steady pace with acks=all and records which values
    the cluster acknowledged (and which it refused) through delivery reports."""

    def __init__(self, settings: Settings, records: list[tuple[int, bytes]], pace_s: float) -> None:
        super().__init__(daemon=True)
        self.settings, self.records, self.pace_s = settings, records, pace_s
        self.acked: list[bytes] = []
        self.failed: list[str] = []
        self.sent = 0

    def _report(self, err, msg) -> None:
        if err is None:
            self.acked.append(msg.value())
        else:
            self.failed.append(str(err))

    def run(self) -> None:
        # Retries outlast a broker loss and a leader election.
        p = Producer(producer_config(self.settings, **{"message.timeout.ms": 120_000}))
        topic = self.settings.topics.name("events")
        for wid, value in self.records:
            p.produce(topic, value, key=wid.to_bytes(8, "big"), on_delivery=self._report)
            self.sent += 1
            p.poll(0)
            time.sleep(self.pace_s)
        p.flush(150)


def _records(seed: int) -> list[tuple[int, bytes]]:
    logs, _ = random_log(seed, workers=9, batches=30)
    codec = AvroCodec()
    return [(codec.decode(v)[1]["worker_id"], v) for recs in logs.values() for _, v in recs]


def _check(replicas: list[Replica], settings: Settings, acked: list[bytes]) -> int:
    log = read_log(settings, timeout=120)
    on_log = {r.value for r in log}
    missing = [v for v in acked if v not in on_log]
    assert not missing, f"{len(missing)} acknowledged records are not on the log"
    for r in replicas:
        wait_caught_up(r, settings, timeout=180)  # past every acknowledged record
        agrees_with_log(r, settings)
    return len(log)


@pytest.mark.timeout(900)
def test_broker_loss_and_full_cluster_restart(three_brokers: LocalCluster) -> None:
    started = time.monotonic()
    settings = Settings(
        bootstrap=three_brokers.bootstrap,
        topics=TopicSettings(prefix=f"faults.{uuid.uuid4().hex[:8]}.", events_partitions=3),
    )
    events = ensure_topics(settings)[0]
    assert events.replication_factor == 3 and events.config["min.insync.replicas"] == "2"
    a, b = start(settings), start(settings)
    replicas = [a, b]
    try:
        # 1. One broker dies mid-stream, then comes back.
        pub = Publisher(settings, _records(21), pace_s=0.01)
        pub.start()
        until_sent(pub, len(pub.records) // 3)
        # The leader of partition 0 (node ids are the local cluster's node indexes):
        # its loss forces a leader election under the publisher and the consumers.
        topic = settings.topics.name("events")
        victim = AdminClient(admin_config(settings)).list_topics(topic, timeout=30).topics[topic].partitions[0].leader
        kill_broker(three_brokers.dir, victim, signal.SIGKILL)
        killed_at = pub.sent
        until_sent(pub, 2 * len(pub.records) // 3)
        restart_broker(three_brokers.dir, victim)
        pub.join(180)
        assert not pub.is_alive()
        assert pub.failed == [] and len(pub.acked) == len(pub.records)
        records_after_loss = _check(replicas, settings, pub.acked)

        # 2. The whole cluster is killed (SIGKILL, all at once) and restarted; replicas
        # keep running across it and reconnect.
        for n in (1, 2, 3):
            kill_broker(three_brokers.dir, n, signal.SIGKILL)
        assert all(pid is None for pid in cluster_status(three_brokers.dir).nodes.values())
        # A node waits for the controller quorum (2 of 3) to serve: start them together.
        with ThreadPoolExecutor(3) as pool:
            list(pool.map(lambda n: restart_broker(three_brokers.dir, n), (1, 2, 3)))
        assert cluster_status(three_brokers.dir).running
        second = Publisher(settings, _records(22), pace_s=0.0)
        second.run()  # after the restart, and more records on top
        assert second.failed == [] and len(second.acked) == len(second.records)
        total = _check(replicas, settings, pub.acked + second.acked)
        # A replica started after it all folds the same log.
        late = start(settings)
        replicas.append(late)
        _check([late], settings, [])
    finally:
        for r in replicas:
            r.stop()
    print(f"FAULTS brokers victim=node-{victim} killed_after={killed_at} acked={len(pub.acked)}+{len(second.acked)} "
          f"failed={len(pub.failed) + len(second.failed)} log_records={records_after_loss}->{total} "
          f"replicas=3 duration_s={time.monotonic() - started:.1f}")


def until_sent(pub: Publisher, n: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while pub.sent < n:
        assert pub.is_alive() and time.monotonic() < deadline, "publisher stalled"
        time.sleep(0.01)
