"""The emulator's KV events, read with vLLM 0.33's own ``KVEventBatch`` (pinned wheel):
the PUB frames, re-encoding byte for byte, parents and token ids, output blocks, the
replay socket, evictions when G1 is full, the DP rank."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq
from engines.engines import EngineKit

from .conftest import Emulator, EventTap

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def complete(emu: Emulator, prompt: list[int], max_tokens: int = 1) -> dict[str, Any]:
    status, body = emu.post("/v1/completions", {"prompt": prompt, "max_tokens": max_tokens})
    assert status == 200, body
    return body


def stored(batches: list[tuple[int, Any]], vllm: EngineKit) -> list[Any]:
    return [e for _, b in batches for e in b.events if isinstance(e, vllm.mod.BlockStored)]


def test_events_decode_with_vllms_classes(emulator_factory: Callable[..., Emulator],
                                          tap_factory: Callable[[str], EventTap], vllm: EngineKit) -> None:
    emu = emulator_factory("--speed", "20")
    tap = tap_factory(emu.events)
    prompt = list(range(500, 540))  # 2 full blocks and 8 tokens
    complete(emu, prompt)
    complete(emu, prompt[:32] + list(range(900, 920)))  # shares 2 blocks, fills a third
    batches = tap.batches()
    assert [seq for seq, _ in batches] == list(range(len(batches)))
    for _, b in batches:
        assert isinstance(b, vllm.mod.KVEventBatch) and b.data_parallel_rank == 0
    first, second = stored(batches, vllm)
    assert first.parent_block_hash is None and first.token_ids == prompt[:32] and len(first.block_hashes) == 2
    assert first.block_size == 16 and first.medium == "GPU" and first.lora_id is None and first.lora_name is None
    assert first.extra_keys is None and first.group_idx == 0
    assert all(isinstance(h, int) and 0 <= h < 1 << 64 for h in first.block_hashes)
    assert second.parent_block_hash == first.block_hashes[1] and second.token_ids == list(range(900, 916))
    assert second.block_hashes[0] not in first.block_hashes


def test_the_payload_is_what_vllm_would_encode(emulator_factory: Callable[..., Emulator], vllm: EngineKit) -> None:
    """Byte for byte: vLLM's encoder of the decoded batch gives the emulator's payload."""
    emu = emulator_factory("--speed", "20")
    sock = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(emu.events)
    try:
        time.sleep(0.3)  # ZMQ's slow joiner
        status, _ = emu.post("/v1/completions", {"prompt": list(range(64)), "max_tokens": 20, "cache_salt": "s1"})
        assert status == 200
        decoder = msgspec.msgpack.Decoder(type=vllm.mod.KVEventBatch)
        encoder = msgspec.msgpack.Encoder()
        payloads = []
        while sock.poll(2000):
            payloads.append(sock.recv_multipart()[2])
        assert payloads
        for p in payloads:
            assert encoder.encode(decoder.decode(p)) == p
        events = [e for p in payloads for e in decoder.decode(p).events]
        # The salt is the first block's extra key, as vLLM publishes it; output blocks
        # (64 + 20 tokens: a fifth block of placeholders) are stored too.
        assert events[0].extra_keys == [("s1",), None, None, None]
        assert sum(len(e.block_hashes) for e in events) == 5
        assert events[-1].parent_block_hash == events[0].block_hashes[-1]
    finally:
        sock.close(linger=0)


def replay(endpoint: str, start: int) -> list[tuple[bytes, int, bytes]]:
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while dealer.poll(5000):
            frames = dealer.recv_multipart()
            assert frames[0] == b""
            if frames[2] == END_SEQ:
                assert frames[1] == b"" and frames[3] == b""
                return out
            out.append((frames[1], int.from_bytes(frames[2], "big"), frames[3]))
        raise AssertionError("no end marker from the replay socket")
    finally:
        dealer.close(linger=0)


def test_replay_socket_answers_as_vllms(emulator_factory: Callable[..., Emulator],
                                       tap_factory: Callable[[str], EventTap], vllm: EngineKit) -> None:
    emu = emulator_factory("--speed", "20", "--kv-events-buffer-steps", "3")
    tap = tap_factory(emu.events)
    for i in range(5):
        complete(emu, list(range(i * 100, i * 100 + 16)))
    live = tap.batches()
    assert [s for s, _ in live] == [0, 1, 2, 3, 4]
    got = replay(emu.replay, 0)  # the buffer keeps the last 3
    assert [seq for _, seq, _ in got] == [2, 3, 4] and all(topic == b"" for topic, _, _ in got)
    for (_, seq, payload), (_, batch) in zip(got, live[2:], strict=True):
        assert tap.decoder.decode(payload).events == batch.events
    assert [seq for _, seq, _ in replay(emu.replay, 4)] == [4]
    assert replay(emu.replay, 99) == []


def test_a_full_g1_evicts_least_recently_used_and_cached_tokens_fall(
        emulator_factory: Callable[..., Emulator], tap_factory: Callable[[str], EventTap], vllm: EngineKit) -> None:
    emu = emulator_factory("--speed", "20", "--num-gpu-blocks", "8", "--max-model-len", "128")
    tap = tap_factory(emu.events)
    a, b, c = (list(range(k * 1000, k * 1000 + 64)) for k in (1, 2, 3))
    complete(emu, a)
    assert complete(emu, a)["usage"]["prompt_tokens_details"]["cached_tokens"] == 48  # the last token is computed
    complete(emu, b)  # takes the 4 never-used blocks
    complete(emu, c)  # takes a's, tail first
    assert complete(emu, a)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    batches = tap.batches()
    events = [e for _, bt in batches for e in bt.events]
    a_hashes = next(e for e in events if isinstance(e, vllm.mod.BlockStored)).block_hashes
    removed = [e.block_hashes[0] for e in events if isinstance(e, vllm.mod.BlockRemoved)]
    # a's repeat recomputed its last block (a second copy, as vLLM keeps it): b's blocks
    # evict the first copy, c's the second and then a's chain, tail first.
    a0, a1, a2, a3 = a_hashes
    assert removed[:5] == [a3, a3, a2, a1, a0]  # (then a, again, evicts b)
    assert all(e.medium == "GPU" for e in events if isinstance(e, vllm.mod.BlockRemoved))


def test_dp_rank_offsets_ports_and_stamps_batches(emulator_factory: Callable[..., Emulator],
                                                 tap_factory: Callable[[str], EventTap], vllm: EngineKit) -> None:
    emu = emulator_factory("--speed", "20", "--data-parallel-rank", "1")
    host, port = emu.events.rsplit(":", 1)
    tap = tap_factory(f"{host}:{int(port) + 1}")
    complete(emu, list(range(32)))
    batches = tap.batches()
    assert batches and all(b.data_parallel_rank == 1 for _, b in batches)
    rhost, rport = emu.replay.rsplit(":", 1)
    assert [seq for _, seq, _ in replay(f"{rhost}:{int(rport) + 1}", 0)] == [s for s, _ in batches]


def test_host_tier_offloads_reloads_and_announces_as_vllm(
        emulator_factory: Callable[..., Emulator], tap_factory: Callable[[str], EventTap], vllm: EngineKit) -> None:
    """With --num-cpu-blocks every block cached on G1 is offloaded (vLLM's default offload
    events: the hash only, medium CPU, one per block) and the host tier evicts its least
    recent blocks to make room (one BlockRemoved per batch)."""
    emu = emulator_factory("--speed", "20", "--num-gpu-blocks", "8", "--num-cpu-blocks", "9", "--max-model-len", "128")
    tap = tap_factory(emu.events)
    a, b, c = (list(range(k * 1000, k * 1000 + 64)) for k in (1, 2, 3))
    complete(emu, a)
    complete(emu, b)
    complete(emu, c)  # G1 (8 blocks) loses a; the host (9 blocks) makes room by dropping a's oldest 3
    # a's chain is broken on the host at its first block: nothing to load.
    assert complete(emu, a)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    batches = tap.batches()
    encoder = msgspec.msgpack.Encoder()
    for _, bt in batches:
        assert tap.decoder.decode(encoder.encode(bt)) == bt
    events = [e for _, bt in batches for e in bt.events]
    gpu = [e for e in events if isinstance(e, vllm.mod.BlockStored) and e.medium == "GPU"]
    cpu = [e for e in events if isinstance(e, vllm.mod.BlockStored) and e.medium == "CPU"]
    assert all(e.block_size == 0 and e.token_ids == [] and e.parent_block_hash is None and len(e.block_hashes) == 1
               for e in cpu)
    assert [e.block_hashes[0] for e in cpu[:4]] == gpu[0].block_hashes  # a, offloaded block by block
    removed_cpu = [h for e in events if isinstance(e, vllm.mod.BlockRemoved) and e.medium == "CPU"
                   for h in e.block_hashes]
    assert removed_cpu[:3] == gpu[0].block_hashes[:3]  # c's 4 blocks made room: a's oldest went
    assert emu.metric("vllm:external_prefix_cache_hits_total") == 0


def test_host_tier_hit_survives_g1_eviction(emulator_factory: Callable[..., Emulator]) -> None:
    emu = emulator_factory("--speed", "20", "--num-gpu-blocks", "8", "--num-cpu-blocks", "64", "--max-model-len", "128")
    a, b, c = (list(range(k * 1000, k * 1000 + 64)) for k in (1, 2, 3))
    for p in (a, b, c):
        complete(emu, p)
    usage = complete(emu, a)["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == 48  # G1 lost a, the host had it
    assert emu.metric("vllm:prefix_cache_hits_total") == 0
    assert emu.metric("vllm:external_prefix_cache_hits_total") == 48


def test_reset_prefix_cache_clears_g1_with_vllms_event(
        emulator_factory: Callable[..., Emulator], tap_factory: Callable[[str], EventTap], vllm: EngineKit) -> None:
    emu = emulator_factory("--speed", "20")
    tap = tap_factory(emu.events)
    prompt = list(range(64))
    complete(emu, prompt)
    status, _ = emu.post("/reset_prefix_cache", {})
    assert status == 200
    assert complete(emu, prompt)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    events = [e for _, b in tap.batches() for e in b.events]
    assert [type(e).__name__ for e in events] == ["BlockStored", "AllBlocksCleared", "BlockStored"]
    assert isinstance(events[1], vllm.mod.AllBlocksCleared)
