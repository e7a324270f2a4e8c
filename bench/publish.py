"""``kvstream bench publish``: block events per second from the ZMQ bridge's input (engine
frames) to acknowledged Kafka writes, against raw confluent-kafka produce of the very
same Kafka messages (pre-encoded bytes) in the same run."""

from __future__ import annotations

import random
import time

import click
import msgpack
from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition

from kvstream.events.codec import EventCodec
from kvstream.events.model import Removed, Stored, Tier
from kvstream.events.wire import worker_key
from kvstream.kafka.config import consumer_config, producer_config
from kvstream.kafka.metadata import topic_partitions
from kvstream.settings import Settings
from bench.common import emit, json_option
from bench.kafka_env import kafka_env
from bench.wire import WireMeter, WireTotals
from kvstream.worker.consolidator import Consolidator, Mode
from kvstream.worker.publisher import KafkaPublisher, PublisherOptions
from kvstream.worker.zmq_bridge import BridgeOptions, Endpoint, ZmqEngineBridge

WORKER_ID = 1


def engine_frames(messages: int, blocks: int, block_size: int, capacity: int, seed: int) -> tuple[list[list[bytes]], int]:
    """vLLM-format engine messages: each stores one new prompt of ``blocks`` blocks and,
    once ``capacity`` blocks are held, first evicts the oldest prompt (as an engine at
    steady state does). Returns the frames and the number of block events in them."""
    rng = random.Random(seed)
    held: list[list[int]] = []
    frames = []
    block_events = 0
    for seq in range(messages):
        events: list[dict[str, object]] = []
        if (len(held) + 1) * blocks > capacity:
            evicted = held.pop(0)
            events.append({"type": "BlockRemoved", "block_hashes": evicted[::-1], "medium": "GPU"})
            block_events += len(evicted)
        # Engine hashes are i64 on the wire, half of them negative.
        hashes = [rng.getrandbits(64) - (1 << 63) for _ in range(blocks)]
        tokens = [rng.randrange(152_064) for _ in range(blocks * block_size)]
        # As vLLM 0.33 encodes it (a msgspec tagged map; tests/engines checks the form).
        events.append(
            {
                "type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None, "token_ids": tokens,
                "block_size": block_size, "lora_id": None, "medium": "GPU", "lora_name": None,
            }
        )
        block_events += blocks
        held.append(hashes)
        payload = msgpack.packb([time.time(), events, 0])
        frames.append([b"", seq.to_bytes(8, "big"), payload])
    return frames, block_events


class _CountingWriter:
    """Takes router events and only counts their blocks: the pipeline without Kafka."""

    def __init__(self) -> None:
        self.blocks = 0

    def stored(
        self, dp_rank: int, tier: Tier, parent_hash: int | None, block_hashes: list[int], tokens_hashes: list[int]
    ) -> None:
        self.blocks += len(block_hashes)

    def removed(self, dp_rank: int, tier: Tier, block_hashes: list[int]) -> None:
        self.blocks += len(block_hashes)

    def cleared(self, dp_rank: int, tier: Tier = Tier.DEVICE) -> None:
        return None


def _read_values(settings: Settings, topic: str) -> list[bytes]:
    """Every record value of ``topic``, in order per partition."""
    consumer = Consumer(consumer_config(settings))
    try:
        parts = topic_partitions(consumer, topic, 30)
        consumer.assign([TopicPartition(topic, p, 0) for p in parts])
        values: list[bytes] = []
        at_end: set[int] = set()
        deadline = time.monotonic() + 120
        while len(at_end) < len(parts) and time.monotonic() < deadline:
            for msg in consumer.consume(1000, timeout=0.5):
                err = msg.error()
                if err is None:
                    values.append(msg.value())
                elif err.code() == KafkaError._PARTITION_EOF:
                    at_end.add(msg.partition())
        return values
    finally:
        consumer.close()


@click.command("publish")
@click.option("--bootstrap", envvar="KVSTREAM_BOOTSTRAP", help="Kafka to use; default: start a local broker for the run.")
@click.option("--messages", default=10_000, show_default=True, help="Engine messages (one BlockStored each).")
@click.option("--blocks", default=16, show_default=True, help="Blocks per BlockStored.")
@click.option("--block-size", default=16, show_default=True)
@click.option("--capacity", default=50_000, show_default=True, help="Blocks the engine holds before it evicts.")
@click.option("--mode", type=click.Choice([m.value for m in Mode]), default=Mode.DEDUP.value, show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.option(
    "--rate", default=0.0, show_default=True,
    help="Engine messages per second, as a steady engine sends them (0: as fast as possible).",
)
@click.option(
    "--producer-set", "producer_set", multiple=True, metavar="KEY=VALUE",
    help="A librdkafka producer setting for this run (ours and the baseline), e.g. linger.ms=20.",
)
@json_option
def publish_bench(
    bootstrap: str | None,
    messages: int,
    blocks: int,
    block_size: int,
    capacity: int,
    mode: str,
    seed: int,
    rate: float,
    producer_set: tuple[str, ...],
    as_json: bool,
) -> None:
    """Engine frames → ZmqEngineBridge.handle_frames → Consolidator → KafkaPublisher →
    acknowledged by Kafka (the clock stops when flush() returns with nothing left). The
    baseline produces the same Kafka messages, already encoded, with the same producer
    settings and waits for them the same way."""
    overrides = {}
    for item in producer_set:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{item!r} is not KEY=VALUE", param_hint="--producer-set")
        overrides[key.strip()] = value.strip()
    frames, block_events = engine_frames(messages, blocks, block_size, capacity, seed)
    with kafka_env(bootstrap) as settings:
        result = _run(settings, frames, block_events, Mode(mode), rate, overrides)
    emit(
        {
            "bench": "publish",
            "messages": messages,
            "blocks_per_event": blocks,
            "block_size": block_size,
            "mode": mode,
            "block_events": block_events,
            "rate": rate,
            "producer_settings": overrides,
            **result,
        },
        as_json,
    )


def _wire_figures(prefix: str, wire: WireTotals, block_events: int) -> dict[str, object]:
    return {
        f"{prefix}wire_bytes_per_block_event": round(wire.tx_bytes / block_events, 2),
        f"{prefix}records_per_produce_request": round(wire.records / max(wire.produce_requests, 1), 2),
    }


def _run(
    settings: Settings, frames: list[list[bytes]], block_events: int, mode: Mode, rate: float,
    overrides: dict[str, str],
) -> dict[str, object]:
    # Without Kafka: parsing, hashing and consolidation alone.
    counter = _CountingWriter()
    bridge = ZmqEngineBridge(BridgeOptions((Endpoint("inproc://unused"),)), Consolidator(counter, mode))
    t0 = time.perf_counter()
    for f in frames:
        bridge.handle_frames(f)
    no_kafka_s = time.perf_counter() - t0
    if counter.blocks != block_events:
        raise click.ClickException(f"pipeline without Kafka saw {counter.blocks} block events, expected {block_events}")

    meter = WireMeter()
    publisher = KafkaPublisher(
        settings,
        PublisherOptions(worker_id=WORKER_ID, listen_control=False, producer_overrides={**overrides, **meter.config()}),
    )
    consolidator = Consolidator(publisher, mode)
    bridge = ZmqEngineBridge(BridgeOptions((Endpoint("inproc://unused"),)), consolidator)
    poll_every = 64 if rate <= 0 else 1
    try:
        if publisher.flush(60):  # warm: connection, metadata, the epoch's first batch
            raise click.ClickException("Kafka did not acknowledge the first batch")
        wire_before = meter.totals(publisher.flush)
        acked_before = publisher.stats.acked_blocks
        t0, cpu0 = time.perf_counter(), time.process_time()
        for i, f in enumerate(frames):
            if rate > 0:
                pause = t0 + i / rate - time.perf_counter()
                if pause > 0:
                    time.sleep(pause)
            bridge.handle_frames(f)
            if i % poll_every == poll_every - 1:
                publisher.poll(consolidator)
        left = publisher.flush(120)
        ours_s = time.perf_counter() - t0
        # CPU of the whole process (librdkafka's threads included): on a shared machine
        # wall time also counts other processes' turns.
        ours_cpu_s = time.process_time() - cpu0
        wire = meter.totals(publisher.flush) - wire_before
        stats = publisher.stats
    finally:
        publisher.close()
    acked = stats.acked_blocks - acked_before
    if left or stats.delivery_failures or acked != block_events:
        raise click.ClickException(
            f"{left} batches unacknowledged, {stats.delivery_failures} failed, {acked} of {block_events} block events acknowledged"
        )

    # Check what is on the log, and take the exact messages for the baseline.
    events_topic = settings.topics.name("events")
    values = _read_values(settings, events_topic)[1:]  # minus the warm-up batch
    codec = EventCodec()
    on_log = sum(
        len(ev.block_hashes) for v in values for ev in codec.decode(v).events if isinstance(ev, Stored | Removed)
    )
    if on_log != block_events:
        raise click.ClickException(f"the log holds {on_log} block events, expected {block_events}")

    base_topic = settings.topics.name("control")  # an existing topic with no other traffic now
    base_meter = WireMeter()
    producer = Producer(
        producer_config(settings, **{"client.id": "kvstream-bench-baseline", **overrides, **base_meter.config()})
    )
    producer.produce(base_topic, value=values[0], key=worker_key(WORKER_ID))
    if producer.flush(60):
        raise click.ClickException("Kafka did not acknowledge the baseline's warm-up message")
    key = worker_key(WORKER_ID)
    base_before = base_meter.totals(producer.poll)
    t0, cpu0 = time.perf_counter(), time.process_time()
    for v in values:
        while True:
            try:
                producer.produce(base_topic, value=v, key=key)
                break
            except BufferError:
                producer.poll(0.01)
        producer.poll(0)
    if producer.flush(120):
        raise click.ClickException("baseline messages unacknowledged")
    base_s = time.perf_counter() - t0
    base_cpu_s = time.process_time() - cpu0
    base_wire = base_meter.totals(producer.poll) - base_before

    ours = block_events / ours_s
    base = block_events / base_s
    return {
        "kafka_messages": len(values),
        "events_per_message": round(stats.events / max(stats.batches, 1), 2),
        "bytes_per_message": round(sum(map(len, values)) / len(values), 1),
        "seconds": round(ours_s, 3),
        "blocks_per_s": round(ours),
        "baseline_seconds": round(base_s, 3),
        "baseline_blocks_per_s": round(base),
        "ratio_to_baseline": round(ours / base, 3),
        "cpu_seconds": round(ours_cpu_s, 3),
        "baseline_cpu_seconds": round(base_cpu_s, 3),
        "blocks_per_cpu_s": round(block_events / ours_cpu_s),
        "no_kafka_blocks_per_s": round(block_events / no_kafka_s),
        **_wire_figures("", wire, block_events),
        **_wire_figures("baseline_", base_wire, block_events),
    }
