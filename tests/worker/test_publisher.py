"""Publisher against the real broker: batches, epochs, ids, keys, back-pressure,
heartbeats, delivery failures and the resync round trip through kvstream.control."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable

import pytest
from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition

from kvstream.events.codec import AvroCodec, EventCodec
from kvstream.events.model import Cleared, EventBatch, Removed, Stored, Tier
from kvstream.hashing import local_hashes, sequence_hashes
from kvstream.kafka.config import consumer_config, producer_config
from kvstream.settings import Settings, TopicSettings
from kvstream.worker.consolidator import Consolidator, Mode
from kvstream.worker.errors import PublisherClosedError, PublisherQueueFullError
from kvstream.worker.engine_node import EngineNode, EngineNodeOptions
from kvstream.worker.publisher import (
    HOUSEKEEPING_S,
    RESYNC_RECORD,
    KafkaPublisher,
    PublisherOptions,
    QueueFull,
    ResyncRequest,
)
from kvstream.worker.zmq_bridge import BridgeOptions, Endpoint
from kvstream.worker.source_events import SourceRemoved, SourceStored

pytestmark = pytest.mark.kafka

WORKER = 7
LOCAL = local_hashes(list(range(16 * 12)), 16)  # 12 blocks
D, H = Tier.DEVICE, Tier.HOST_PINNED


def send_resync_request(settings: Settings, request: ResyncRequest, timeout_s: float = 30.0) -> None:
    """Publish ``request`` on the control topic, as a replica does, and wait until Kafka has it."""
    producer = Producer(producer_config(settings, **{"client.id": "kvstream-resync", "linger.ms": 0}))
    errors: list[KafkaError] = []
    producer.produce(
        settings.topics.name("control"),
        value=AvroCodec().encode(RESYNC_RECORD, request.to_record()),
        on_delivery=lambda err, _msg: errors.append(err) if err else None,
    )
    assert producer.flush(timeout_s) == 0 and not errors, f"resync request not delivered: {errors}"


def read_batches(
    settings: Settings, count: int | None = None, timeout_s: float = 30.0
) -> list[tuple[int, bytes, EventBatch]]:
    """Records of the events topic as (partition, key, batch), in offset order per
    partition: the first ``count``, or (None) all of them up to the current end."""
    topic = settings.topics.name("events")
    consumer = Consumer(consumer_config(settings))
    try:
        parts = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        consumer.assign([TopicPartition(topic, p, 0) for p in parts])
        codec = EventCodec()
        out: list[tuple[int, bytes, EventBatch]] = []
        at_end: set[int] = set()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if count is not None and len(out) >= count or count is None and len(at_end) == len(parts):
                break
            for msg in consumer.consume(100, timeout=0.5):
                err = msg.error()
                if err is None:
                    out.append((msg.partition(), msg.key(), codec.decode(msg.value())))
                elif err.code() == KafkaError._PARTITION_EOF:
                    at_end.add(msg.partition())
        return out
    finally:
        consumer.close()


def options(**kw) -> PublisherOptions:
    kw.setdefault("listen_control", False)
    kw.setdefault("linger_ms", 60_000)  # batches are cut by flush() or size in these tests
    kw.setdefault("heartbeat_s", 5)  # heartbeats go out from poll() only
    return PublisherOptions(worker_id=kw.pop("worker_id", WORKER), **kw)


class NoState:
    """A state source that holds nothing (for tests that resync without blocks)."""

    def replay(self, writer) -> None:
        return None


EMPTY = NoState()


def pump(pub: KafkaPublisher, state, until: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not until():
        assert time.monotonic() < deadline, f"publisher did not get there: {pub.stats}"
        pub.poll(state)
        time.sleep(0.01)


def test_first_batch_coalesced_ids_key(kafka_topics):
    pub = KafkaPublisher(kafka_topics, options())
    try:
        pub.stored(0, D, None, [1, 2], LOCAL[0:2])
        pub.stored(0, D, 2, [3], LOCAL[2:3])  # continues the chain: merged
        pub.stored(1, D, None, [1], LOCAL[0:1])  # other rank
        pub.stored(0, H, 3, [4], LOCAL[3:4])  # other tier: not merged
        pub.removed(0, D, [3])
        pub.removed(0, D, [2, 1])  # consecutive removes: merged
        pub.stored(0, D, None, [9], LOCAL[8:9])  # a new root: not merged
        assert pub.flush(30) == 0
        epoch = pub.epoch
    finally:
        pub.close()
    [(partition, key, batch)] = read_batches(kafka_topics)
    assert key == WORKER.to_bytes(8, "big")
    assert (batch.worker_id, batch.epoch, batch.lease_ms) == (WORKER, epoch, 10_000)
    w, e = WORKER, epoch
    assert batch.events == (
        Cleared(w, 0, D, e, 1),
        Stored(w, 0, D, e, 2, None, (1, 2, 3), tuple(LOCAL[0:3])),
        Stored(w, 1, D, e, 1, None, (1,), tuple(LOCAL[0:1])),
        Stored(w, 0, H, e, 3, 3, (4,), tuple(LOCAL[3:4])),
        Removed(w, 0, D, e, 4, (3, 2, 1)),
        Stored(w, 0, D, e, 5, None, (9,), tuple(LOCAL[8:9])),
    )
    assert pub.stats.acked_batches == 1 and pub.stats.acked_blocks == 9


def test_size_limits_split_batches_and_long_stores(kafka_topics):
    pub = KafkaPublisher(kafka_topics, options(max_batch_blocks=4, max_batch_events=3))
    try:
        pub.stored(0, D, None, list(range(100, 110)), LOCAL[0:10])  # 10 blocks, cap 4
        for i in range(4):
            pub.removed(i, D, [100 + i])  # 4 ranks: 4 events, cap 3
        assert pub.flush(30) == 0
        e = pub.epoch
    finally:
        pub.close()
    batches = [b for _, _, b in read_batches(kafka_topics)]
    w = WORKER
    assert [b.events for b in batches] == [
        (Cleared(w, 0, D, e, 1), Stored(w, 0, D, e, 2, None, (100, 101, 102, 103), tuple(LOCAL[0:4]))),
        (Stored(w, 0, D, e, 3, 103, (104, 105, 106, 107), tuple(LOCAL[4:8])),),
        (Stored(w, 0, D, e, 4, 107, (108, 109), tuple(LOCAL[8:10])), Removed(w, 0, D, e, 5, (100,)), Removed(w, 1, D, e, 1, (101,))),
        (Removed(w, 2, D, e, 1, (102,)), Removed(w, 3, D, e, 1, (103,))),
    ]


def test_restart_is_a_new_greater_epoch_starting_with_cleared(kafka_topics):
    epochs = []
    for block in (1, 2):
        pub = KafkaPublisher(kafka_topics, options())
        pub.stored(0, D, None, [block], LOCAL[0:1])
        assert pub.close(30) == 0
        epochs.append(pub.epoch)
    assert epochs[1] > epochs[0]
    batches = [b for _, _, b in read_batches(kafka_topics)]
    assert [b.epoch for b in batches] == epochs
    for b, block in zip(batches, (1, 2)):
        assert b.events == (
            Cleared(WORKER, 0, D, b.epoch, 1),
            Stored(WORKER, 0, D, b.epoch, 2, None, (block,), tuple(LOCAL[0:1])),
        )


def test_heartbeats_and_linger(kafka_topics):
    pub = KafkaPublisher(kafka_topics, options(heartbeat_s=0.3, linger_ms=50))
    try:
        pub.stored(0, D, None, [1], LOCAL[0:1])
        pump(pub, EMPTY, lambda: pub.stats.batches == 1)  # the linger cut it
        pump(pub, EMPTY, lambda: pub.stats.heartbeats >= 2)
        assert pub.flush(30) == 0
        sent = pub.stats.batches
    finally:
        pub.close()
    batches = [b for _, _, b in read_batches(kafka_topics, sent)]
    assert len(batches[0].events) == 2
    assert all(b.events == () and b.epoch == pub.epoch for b in batches[1:])
    assert len(batches) >= 3


def test_due_in_is_when_poll_has_work(kafka_topics):
    """A worker loop waits for engine messages up to due_in(): a pending batch's linger,
    the next heartbeat, and HOUSEKEEPING_S at most (control requests, delivery reports)."""
    pub = KafkaPublisher(kafka_topics, options(heartbeat_s=5, linger_ms=50))
    try:
        assert pub.due_in() <= 0.05  # the epoch's cleared waits for its linger
        time.sleep(0.06)
        assert pub.due_in() == 0
        pub.poll(EMPTY)
        assert pub.stats.batches == 1
        assert 0 < pub.due_in() <= HOUSEKEEPING_S  # nothing pending, the heartbeat 5 s away
        pub.stored(0, D, None, [1], LOCAL[0:1])
        assert pub.due_in() <= 0.05
    finally:
        pub.close()
    beating = KafkaPublisher(kafka_topics, options(heartbeat_s=0.02, linger_ms=60_000))
    try:
        assert beating.due_in() <= 0.02
    finally:
        beating.close()


def test_an_idle_engine_node_waits_instead_of_spinning(kafka_topics):
    """With nothing from its engine, the loop wakes for the publisher's housekeeping
    only (it woke every linger, 5 ms: 200 times a second)."""
    opts = EngineNodeOptions(options(linger_ms=5), BridgeOptions((Endpoint("tcp://127.0.0.1:9"),), replay_timeout_ms=100))
    node = EngineNode(kafka_topics, opts)
    steps = 0
    step = node.step

    def counted(timeout_ms: int) -> None:
        nonlocal steps
        steps += 1
        step(timeout_ms)

    node.step = counted  # type: ignore[method-assign]
    stop = threading.Event()
    try:
        node.start()
        t = threading.Thread(target=node.run, args=(stop,))
        t.start()
        time.sleep(1.0)
        stop.set()
        t.join(10)
    finally:
        node.close()
    assert 1 <= steps <= 3 / HOUSEKEEPING_S, steps


def test_queue_full_fails_loudly_then_resyncs(kafka_topics):
    # Two events per batch; a queue of one message that lingers 2 s: the second batch
    # finds the queue full.
    pub = KafkaPublisher(
        kafka_topics,
        options(
            max_batch_events=2,
            queue_max_messages=1,
            queue_full=QueueFull.FAIL,
            producer_overrides={"linger.ms": 2000},
        ),
    )
    try:
        pub.stored(0, D, None, [1], LOCAL[0:1])  # with the epoch's cleared: batch 1
        pub.stored(0, D, None, [2], LOCAL[0:1])
        with pytest.raises(PublisherQueueFullError, match="queue full"):
            pub.stored(0, D, None, [3], LOCAL[1:2])
        first_epoch = pub.epoch
        assert pub.flush(30) == 0
        pump(pub, EMPTY, lambda: pub.stats.resyncs == 1)
        assert pub.epoch > first_epoch
        assert pub.flush(30) == 0
    finally:
        pub.close()
    batches = [b for _, _, b in read_batches(kafka_topics, 2)]
    assert [(b.epoch, [type(e).__name__ for e in b.events]) for b in batches] == [
        (first_epoch, ["Cleared", "Stored"]),
        (pub.epoch, ["Cleared"]),  # the refused batch never went out; a resync followed
    ]


def test_queue_full_blocks_until_room(kafka_topics):
    pub = KafkaPublisher(
        kafka_topics,
        options(max_batch_events=2, queue_max_messages=1, block_timeout_s=30, producer_overrides={"linger.ms": 200}),
    )
    try:
        pub.stored(0, D, None, [1], LOCAL[0:1])
        pub.stored(0, D, None, [2], LOCAL[0:1])
        pub.stored(0, D, None, [3], LOCAL[1:2])  # waits for the first delivery
        assert pub.stats.queue_full_waits == 1
        assert pub.flush(30) == 0
    finally:
        pub.close()
    batches = [b for _, _, b in read_batches(kafka_topics)]
    assert [[e.event_id for e in b.events] for b in batches] == [[1, 2], [3, 4]]


def test_delivery_failure_counted_and_retried_as_resync(kafka_bootstrap):
    # Topics that do not exist (the broker does not auto-create): every delivery fails.
    settings = Settings(bootstrap=kafka_bootstrap, topics=TopicSettings(prefix=f"absent.{uuid.uuid4().hex}."))
    pub = KafkaPublisher(
        settings,
        options(
            resync_backoff_s=0.2,
            producer_overrides={"message.timeout.ms": 500, "topic.metadata.propagation.max.ms": 100},
        ),
    )
    try:
        pub.stored(0, D, None, [1], LOCAL[0:1])
        assert pub.flush(10) == 0  # nothing left in the queue: it failed
        assert pub.stats.delivery_failures == 1 and pub.stats.acked_batches == 0
        epoch = pub.epoch
        pump(pub, EMPTY, lambda: pub.stats.resyncs == 1)
        assert pub.epoch > epoch
    finally:
        pub.close(5)


def test_closed_publisher_refuses_events(kafka_topics):
    pub = KafkaPublisher(kafka_topics, options())
    pub.stored(0, D, None, [1], LOCAL[0:1])
    assert pub.close(30) == 0
    assert pub.close() == 0  # idempotent
    with pytest.raises(PublisherClosedError):
        pub.stored(0, D, None, [2], LOCAL[0:1])
    [(_, _, batch)] = read_batches(kafka_topics)
    assert len(batch.events) == 2  # close sent what was pending, whole


def fold(batches: list[EventBatch]) -> tuple[dict[int, set[int]], int]:
    """Router-side view of one worker: per rank, the sequence hashes of device blocks;
    and the epoch applied last. Applies only the last epoch's events from its cleared."""
    chains: dict[int, dict[int, int]] = {}
    epoch = 0
    last_id: dict[int, int] = {}
    for b in batches:
        for ev in b.events:
            if b.epoch != epoch:
                assert b.epoch > epoch and isinstance(ev, Cleared), "an epoch starts with cleared"
                epoch, last_id = b.epoch, {}
            assert ev.event_id > last_id.get(ev.dp_rank, 0), "ids strictly increase per rank"
            last_id[ev.dp_rank] = ev.event_id
            if isinstance(ev, Cleared):
                chains.clear()
            elif isinstance(ev, Stored):
                chain = chains.setdefault(ev.dp_rank, {})
                prev = None if ev.parent_hash is None else chain[ev.parent_hash]
                for h, s in zip(ev.block_hashes, sequence_hashes(list(ev.tokens_hashes), prev)):
                    chain[h] = s
            else:
                for h in ev.block_hashes:
                    del chains[ev.dp_rank][h]
    return {r: set(c.values()) for r, c in chains.items() if c}, epoch


def test_resync_round_trip_through_the_broker(kafka_topics):
    pub = KafkaPublisher(kafka_topics, options(listen_control=True, linger_ms=5))
    cons = Consolidator(pub, Mode.DEDUP)
    try:
        for rank in (0, 1):
            cons.on_source_event(SourceStored(D, rank, None, (11, 12, 13), tuple(LOCAL[0:3])))
            cons.on_source_event(SourceStored(H, rank, None, (21, 22, 23, 24), tuple(LOCAL[0:4])))
        cons.on_source_event(SourceRemoved(D, 0, (13,)))
        assert pub.flush(30) == 0
        first_epoch = pub.epoch
        live = read_batches(kafka_topics, pub.stats.batches)
        assert len({p for p, _, _ in live}) == 1
        live_state, _ = fold([b for _, _, b in live])

        # A request for another worker is not ours.
        send_resync_request(kafka_topics, ResyncRequest(WORKER + 1, "replica-a", "test", 0))
        send_resync_request(kafka_topics, ResyncRequest(WORKER, "replica-a", "offset out of range", 0))
        pump(pub, cons, lambda: pub.stats.resyncs == 1)
        assert pub.stats.resync_requests == 1
        assert pub.flush(30) == 0
        total = pub.stats.batches
    finally:
        pub.close()
    everything = read_batches(kafka_topics, total)
    assert len({p for p, _, _ in everything}) == 1  # one worker, one partition
    batches = [b for _, _, b in everything]
    resynced = [b for b in batches if b.epoch != first_epoch]
    assert resynced and resynced[0].events[0] == Cleared(WORKER, 0, D, resynced[0].epoch, 1)
    state, epoch = fold(batches)
    assert epoch == pub.epoch > first_epoch
    expected = {r: set(sequence_hashes(LOCAL[0:4])) for r in (0, 1)}
    assert live_state == state == expected
    # Replaying only the new epoch gives the same state: it is self-contained.
    assert fold(resynced)[0] == expected
