"""Engine conformance: vLLM's and SGLang's own KV-event publishers (their pinned wheels,
their ZmqEventPublisher and event classes) → kvstream engine worker → Kafka → replica.

Every case runs for both engines where the engine has the feature; the cases that are
one engine's own (vLLM offload placeholders, extra_keys...) name it.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace

from kvstream.events.model import Tier
from kvstream.hashing import MmSpan, local_hashes, sequence_hashes
from kvstream.router.index import TierOverlap, WorkerKey
from kvstream.router.scheduler import SchedulerOverrides
from kvstream.worker.consolidator import Mode
from kvstream.worker.zmq_bridge import Flavour, Issue

from .conftest import Env, Rig, eventually, tokens
from .engines import EngineKit

T = tokens(6)  # 6 blocks of 16


def test_stores_with_parents_and_routing(env: Env, engine: EngineKit) -> None:
    with Rig(env, engine, mode=Mode.DEDUP) as a, Rig(env, engine, mode=Mode.DEDUP) as b:
        a.publish(engine.stored([-101, 102], None, T[:32]))
        a.publish(engine.stored([103, 104], 102, T[32:64]))
        b.publish(engine.stored([201], None, T[:16]))
        a.sees(T, TierOverlap(device=4))
        b.sees(T, TierOverlap(device=1))
        allowed = SchedulerOverrides(allowed_workers=frozenset({a.worker_id, b.worker_id}))
        decision = env.replica.route(T + [1, 2, 3], query_only=True, overrides=allowed)  # a partial tail
        assert decision.worker == WorkerKey(a.worker_id, 0)
        assert not a.problems() and not a.node.consolidator.anomalies


def test_bytes_block_hashes(env: Env, vllm: EngineKit) -> None:
    # vLLM's sha256 prefix caching publishes 32-byte digests as block hashes.
    d = [hashlib.sha256(bytes([i])).digest() for i in range(3)]
    with Rig(env, vllm) as r:
        r.publish(vllm.stored(d[:2], None, T[:32]), vllm.stored(d[2:], d[1], T[32:48]))
        r.sees(T, TierOverlap(device=3))
        r.publish(vllm.removed([d[2]]))
        r.sees(T, TierOverlap(device=2))


def test_removals(env: Env, engine: EngineKit) -> None:
    with Rig(env, engine) as r:
        r.publish(engine.stored([1, 2, 3], None, T[:48]))
        r.sees(T, TierOverlap(device=3))
        r.publish(engine.removed([3]))
        r.sees(T, TierOverlap(device=2))
        r.publish(engine.removed([99]))  # never stored: counted, skipped
        r.publish(engine.removed([1, 2]))
        r.sees(T, TierOverlap())
        eventually(lambda: r.node.consolidator.anomalies["unknown_remove"], 1)


def test_clear_scope_is_the_engines(env: Env, engine: EngineKit) -> None:
    """vLLM's reset clears its GPU prefix cache (the CPU offload cache survives); SGLang's
    clears device and host."""
    with Rig(env, engine) as r:
        host = engine.host_medium
        r.publish(engine.stored([1, 2], None, T[:32]), engine.stored([1, 2], None, T[:32], medium=host))
        r.sees(T, TierOverlap(device=2))
        r.sees(T[32:], TierOverlap())
        assert r.overlap(T) == TierOverlap(device=2)  # host continues only past the device
        r.publish(engine.cleared())
        expected = TierOverlap(host_pinned=2) if engine.name == "vllm" else TierOverlap()
        r.sees(T, expected)


def test_clear_scope_detected_from_fields(env: Env, engine: EngineKit) -> None:
    with Rig(env, engine, flavour=Flavour.AUTO) as r:
        host = engine.host_medium
        r.publish(engine.stored([1], None, T[:16]), engine.stored([1], None, T[:16], medium=host))
        r.publish(engine.cleared())
        r.sees(T, TierOverlap(host_pinned=1) if engine.name == "vllm" else TierOverlap())
        assert r.node.bridge.converter.flavour is Flavour(engine.name)


def test_lora(env: Env, engine: EngineKit) -> None:
    with Rig(env, engine) as r:
        r.publish(engine.stored([7, 8], None, T[:32], lora_name="my-lora", lora_id=3))
        r.sees(T, TierOverlap(device=2), lora_name="my-lora")
        assert r.overlap(T) == TierOverlap()
        assert r.overlap(T, lora_name="other") == TierOverlap()


def test_gap_repaired_from_the_replay_buffer(env: Env, engine: EngineKit) -> None:
    # A publisher and a subscriber with tiny queues and a worker that is not reading:
    # messages are dropped in between; what the worker missed comes from the replay
    # buffer, in order.
    r = Rig(env, engine, publisher_kw={"hwm": 1})
    r.options = replace(r.options, bridge=replace(r.options.bridge, rcvhwm=1))
    with r:
        r.publish(engine.stored([1], None, T[:16]))
        r.synced()
        r.pause_worker()
        parent = 1
        for i in range(1, 300):
            h = 1 + i
            r.publish(engine.stored([h], parent, tokens(1, 16 * (i % 5 + 1) * 1000)), engine.removed([h]))
        r.publish(engine.stored([1000], 1, T[16:32]))
        r.resume_worker()
        r.sees(T, TierOverlap(device=2))
        issues = r.node.bridge.issues
        assert issues[Issue.GAP] == r.node.bridge.stats.replayed  # every miss recovered
        assert not issues[Issue.UNRECOVERED]
        assert not r.node.consolidator.anomalies


def test_worker_joining_a_running_engine_replays_its_history(env: Env, engine: EngineKit) -> None:
    r = Rig(env, engine)
    try:
        r.publish(engine.stored([1, 2], None, T[:32]))
        r.publish(engine.stored([3], 2, T[32:48]))
        r.wait_sent()
        r.start_worker()  # after the engine published: both come from its buffer
        r.publish(engine.stored([4], 3, T[48:64]))
        r.sees(T, TierOverlap(device=4))
        assert r.node.bridge.stats.replayed >= 2 and not r.node.bridge.issues[Issue.UNRECOVERED]
    finally:
        r.__exit__()


def test_engine_restart(env: Env, engine: EngineKit) -> None:
    with Rig(env, engine) as r:
        host = engine.host_medium
        r.publish(engine.stored([1, 2], None, T[:32]), engine.stored([1], None, T[:16], medium=host))
        r.sees(T, TierOverlap(device=2))
        r.stop_engine()
        r.start_engine()  # a new engine process: empty caches, sequence from 0
        r.publish(engine.stored([5], None, T[:16]))
        r.publish(engine.stored([6], 5, T[16:32]))
        r.publish(engine.stored([7], 6, T[32:48]))
        r.sees(T, TierOverlap(device=3))
        assert r.overlap(T[16:]) == TierOverlap()  # nothing of the old process is left
        assert r.node.bridge.issues[Issue.ENGINE_RESTART] == 1


def test_data_parallel_ranks_under_one_worker(env: Env, engine: EngineKit) -> None:
    """One publisher per DP rank, each on its own port (the engine's offset) and with its
    own sequence; one kvstream worker, one epoch; a clear on rank 1 leaves rank 0."""
    with Rig(env, engine, ranks=2) as r:
        r.publish(engine.stored([1, 2], None, T[:32]), rank=0)
        r.publish(engine.stored([1, 2, 3], None, T[:48]), rank=1)
        r.sees(T, TierOverlap(device=2), rank=0)
        r.sees(T, TierOverlap(device=3), rank=1)
        epoch = r.epoch()
        r.publish(engine.cleared(), rank=1)
        r.sees(T, TierOverlap(), rank=1)
        assert r.overlap(T, 0) == TierOverlap(device=2)
        assert r.epoch() == epoch
        with env.replica.lock:
            assert not env.replica.fold.counters["batch_stale_epoch"]


def test_block_size_mismatch_counted(env: Env, engine: EngineKit) -> None:
    # SGLang's default page size is 1: one-token blocks never match 16-token routing.
    with Rig(env, engine) as r:
        r.publish(engine.stored(list(range(1, 33)), None, T[:32], block_size=1))
        r.publish(engine.stored([100], None, T[:16]))
        r.sees(T, TierOverlap(device=1))
        assert r.node.bridge.issues[Issue.BLOCK_SIZE_MISMATCH] == 32
        # The routers show it too (/v1/workers), from the worker's batches.
        eventually(
            lambda: env.replica.workers_view()["workers"][str(r.worker_id)].get("engine_issues"),
            {"block_size_mismatch": 32},
        )


def test_route_over_http_with_salt_and_multimodal(env: Env, sglang: EngineKit) -> None:
    """POST /v1/route with cache_salt and mm spans credits the worker holding those
    blocks, and a plain prompt the one holding plain blocks."""
    from fastapi.testclient import TestClient

    from kvstream.replica.service import create_app

    with Rig(env, sglang) as salted, Rig(env, sglang) as plain:
        salted.publish(sglang.stored([1, 2, 3], None, T[:48], cache_salt="tenant-a"))
        plain.publish(sglang.stored([1, 2], None, T[:32]))
        salted.sees(T, TierOverlap(device=3), cache_salt="tenant-a")
        plain.sees(T, TierOverlap(device=2))
        client = TestClient(create_app(env.replica))
        body = {"token_ids": T, "query_only": True, "weights": {"allowed_workers": [salted.worker_id, plain.worker_id]}}
        assert client.post("/v1/route", json={**body, "cache_salt": "tenant-a"}).json()["worker_id"] == salted.worker_id
        assert client.post("/v1/route", json=body).json()["worker_id"] == plain.worker_id
        bad = client.post("/v1/route", json={**body, "mm": [{"hash": 1, "offset": 0, "length": 0}]})
        assert bad.status_code == 422


def test_partial_tail_page_sglang(env: Env, sglang: EngineKit) -> None:
    # SGLang publishes a node's last page even when it is partial, with its own size.
    with Rig(env, sglang) as r:
        r.publish(sglang.stored([1, 2], None, T[:32]), sglang.stored([3], 2, T[32:37], block_size=5))
        r.sees(T, TierOverlap(device=2))
        assert r.problems() == {Issue.PARTIAL_BLOCK: 1}


def test_cache_salt_sglang(env: Env, sglang: EngineKit) -> None:
    with Rig(env, sglang) as r:
        r.publish(sglang.stored([1, 2], None, T[:32], cache_salt="tenant-a"))
        r.publish(sglang.stored([3], 2, T[32:48], cache_salt="tenant-a"))
        r.sees(T, TierOverlap(device=3), cache_salt="tenant-a")
        assert r.overlap(T) == TierOverlap()
        assert r.overlap(T, cache_salt="tenant-b") == TierOverlap()


def test_extra_keys_vllm(env: Env, vllm: EngineKit) -> None:
    """vLLM names the cache salt in the first block's extra keys (children inherit it)
    and multimodal objects as (identifier, offset) in each block they touch; as Dynamo,
    a digest identifier's first 16 hex digits are the object's hash."""
    img = hashlib.sha256(b"an image").hexdigest()
    with Rig(env, vllm) as r:
        r.publish(vllm.stored([1, 2], None, T[:32], extra_keys=[("salt-1",), ((img, 4),)]))
        r.publish(vllm.stored([3], 2, T[32:48], extra_keys=[((img, 0),)]))
        r.publish(vllm.stored([4], 3, T[48:64], extra_keys=[None]))
        span = (MmSpan(int(img[:16], 16), 20, 28),)  # positions 20..47: blocks 1 and 2
        r.sees(T, TierOverlap(device=4), cache_salt="salt-1", mm=span)
        assert r.overlap(T, cache_salt="salt-1") == TierOverlap(device=1)
        assert r.overlap(T) == TierOverlap()
        # A user-given identifier (not a digest) has no form on the routing side.
        r.publish(vllm.stored([9], None, T[16:32], extra_keys=[(("my-image-uuid", 0),)]))
        r.synced()
        assert r.node.bridge.issues[Issue.UNSUPPORTED_IDENTITY] == 1


def test_eagle_pages_sglang(env: Env, sglang: EngineKit) -> None:
    # SGLang's EAGLE (bigram) pages: (token, next token) pairs.
    with Rig(env, sglang) as r:
        pairs = [(T[i], T[i + 1]) for i in range(32)]
        r.publish(sglang.stored([1, 2], None, pairs))
        r.synced()
        want = sorted(sequence_hashes(local_hashes(T[:32], 16, extra_tokens=[[T[16]], [T[32]]])))

        def positions() -> list[int]:
            with env.replica.lock:
                return sorted(env.replica.router.blocks(WorkerKey(r.worker_id, 0), Tier.DEVICE).values())

        eventually(positions, want)


def test_extra_keys_with_lora_vllm(env: Env, vllm: EngineKit) -> None:
    with Rig(env, vllm) as r:
        r.publish(vllm.stored([1], None, T[:16], lora_name="ad", lora_id=1, extra_keys=[("ad", "s")]))
        r.sees(T, TierOverlap(device=1), lora_name="ad", cache_salt="s")


def test_prompt_embeds_unsupported_vllm(env: Env, vllm: EngineKit) -> None:
    with Rig(env, vllm) as r:
        r.publish(vllm.stored([1], None, T[:16], extra_keys=[(b"\x01" * 32,)]))
        r.publish(vllm.stored([2], None, T[16:32]))
        r.sees(T[16:], TierOverlap(device=1))
        assert r.overlap(T) == TierOverlap()
        assert r.node.bridge.issues[Issue.UNSUPPORTED_IDENTITY] == 1


def test_lookahead_tokens_vllm(env: Env, vllm: EngineKit) -> None:
    # One lookahead token per block is Dynamo's EAGLE window (block + next token).
    with Rig(env, vllm) as r:
        extra = [[T[16]], [T[32]]]
        r.publish(vllm.stored([1, 2], None, T[:32], lookahead_token_ids=extra))
        r.synced()
        want = sorted(sequence_hashes(local_hashes(T[:32], 16, extra_tokens=extra)))

        def positions() -> list[int]:
            with env.replica.lock:
                return sorted(env.replica.router.blocks(WorkerKey(r.worker_id, 0), Tier.DEVICE).values())

        eventually(positions, want)
        assert r.overlap(T) == TierOverlap()  # plain prompts do not match EAGLE-window blocks


def test_storage_medium_is_disk(env: Env, engine: EngineKit) -> None:
    # vLLM's file / object offloading tiers; SGLang's L3.
    disk = "STORAGE" if engine.name == "vllm" else engine.mod.StorageMedium.DISK.value
    with Rig(env, engine) as r:
        r.publish(engine.stored([1, 2], None, T[:32], medium=disk))
        r.sees(T, TierOverlap(disk=2))
        assert not r.problems()


def test_offload_placeholders_resolved_vllm(env: Env, vllm: EngineKit) -> None:
    """vLLM's default offload events carry no tokens (block_size 0, no parent); the GPU
    source knows those hashes."""
    with Rig(env, vllm) as r:
        r.publish(vllm.stored([1, 2, 3], None, T[:48]))
        r.publish(vllm.stored([1, 2], None, [], 0, medium="CPU"))
        r.publish(vllm.stored([3, 77], None, [], 0, medium="CPU"))  # 77: never on the GPU
        r.publish(vllm.removed([1, 2, 3]))
        r.sees(T, TierOverlap(host_pinned=3))
        assert r.node.bridge.issues[Issue.UNRESOLVED_PLACEHOLDER] == 1


def test_offload_placeholders_of_multi_block_chunks_vllm(env: Env, vllm: EngineKit) -> None:
    """With the offloading connector's blocks_per_chunk 2, a placeholder names a chunk by
    its last block (its eviction too): the chunk is that block and its parent on the
    GPU; what the GPU can no longer name is counted."""
    r = Rig(env, vllm)
    r.options = replace(r.options, bridge=replace(r.options.bridge, offload_blocks_per_chunk=2))
    with r:
        r.publish(vllm.stored([1, 2, 3, 4, 5, 6], None, T[:96]))
        r.publish(vllm.stored([2], None, [], 0, medium="CPU"))  # chunk 0: blocks 1, 2
        r.publish(vllm.stored([4], None, [], 0, medium="CPU"))  # chunk 1: blocks 3, 4
        r.publish(vllm.removed([5]))  # the GPU lost the start of chunk 2
        r.publish(vllm.stored([6], None, [], 0, medium="CPU"))
        r.publish(vllm.removed([1, 2, 3, 4, 6]))
        r.sees(T, TierOverlap(host_pinned=4))
        assert r.node.bridge.issues[Issue.UNRESOLVED_PLACEHOLDER] == 2
        eventually(
            lambda: env.replica.workers_view()["workers"][str(r.worker_id)].get("engine_issues"),
            {"unresolved_placeholder": 2},
        )
        r.publish(vllm.removed([4], medium="CPU"))  # chunk 1 evicted, named by its last block
        r.sees(T, TierOverlap(host_pinned=2))
        assert not r.node.consolidator.anomalies


def test_offload_chunks_sharing_a_block_vllm(env: Env, vllm: EngineKit) -> None:
    """Self-describing offload events announce a block shared by two chunks once per
    chunk, and its removal once per chunk evicted: it stays until the last."""
    with Rig(env, vllm) as r:
        r.publish(vllm.stored([1], None, T[:16]))
        r.publish(vllm.stored([1, 2], None, T[:32], medium="CPU"))  # chunk A
        r.publish(vllm.stored([2, 3], 1, T[16:48], medium="CPU"))  # chunk B repeats block 2
        r.publish(vllm.removed([1, 2], medium="CPU"))  # chunk A evicted
        r.sees(T, TierOverlap(device=1, host_pinned=2))
        r.publish(vllm.removed([2, 3], medium="CPU"))  # chunk B evicted
        r.sees(T, TierOverlap(device=1))
        assert not r.node.consolidator.anomalies


def test_reannouncements_counted_not_anomalies(env: Env, engine: EngineKit) -> None:
    # vLLM's kv_cache_report_mode="full": cached prefixes are announced again on reuse.
    with Rig(env, engine) as r:
        r.publish(engine.stored([1, 2], None, T[:32]))
        r.publish(engine.stored([1, 2], None, T[:32]), engine.stored([3], 2, T[32:48]))
        r.sees(T, TierOverlap(device=3))
        assert r.node.consolidator.reannounced == {Tier.DEVICE: 2}
        assert not r.node.consolidator.anomalies


def test_remote_locality_is_external_vllm(env: Env, vllm: EngineKit) -> None:
    with Rig(env, vllm) as r:
        r.publish(vllm.stored([1, 2], None, T[:32], medium="CPU", locality="REMOTE"))
        r.sees(T, TierOverlap(external=2))
        r.publish(vllm.removed([2], medium="CPU", locality="REMOTE"))
        r.sees(T, TierOverlap(external=1))


def test_other_kv_groups_counted_vllm(env: Env, vllm: EngineKit) -> None:
    with Rig(env, vllm) as r:
        r.publish(
            vllm.stored([1], None, T[:16], group_idx=1, kv_cache_spec_kind="sliding_window"),
            vllm.stored([2], None, T[:16], group_idx=0),
            vllm.removed([1], group_idx=1),
        )
        r.sees(T, TierOverlap(device=1))
        assert r.node.bridge.issues[Issue.OTHER_KV_GROUP] == 2


def test_signed_and_unsigned_block_hashes_are_one_block_vllm(env: Env, vllm: EngineKit) -> None:
    """TensorRT-LLM publishes the vLLM format with block hashes as signed int64; a hash
    named in either signedness is the same u64 block."""
    big = [(1 << 63) + 5, (1 << 64) - 7, (1 << 63) + 11]
    signed = [h - (1 << 64) for h in big]
    with Rig(env, vllm) as r:
        r.publish(vllm.stored(signed[:2], None, T[:32]))
        r.publish(vllm.stored([big[2]], signed[1] + (1 << 64), T[32:48]))  # its parent, unsigned
        r.sees(T, TierOverlap(device=3))
        r.publish(vllm.removed([signed[2]]), vllm.removed([big[1]]))
        r.sees(T, TierOverlap(device=1))
        assert not r.problems() and not r.node.consolidator.anomalies


def test_positional_events_sglang(env: Env, sglang: EngineKit) -> None:
    """SGLang's positional form (msgspec ``array_like``, as its PRs describe): its own
    event classes, encoded as arrays in its field order, where the salt precedes the
    LoRA name."""
    import msgspec

    mod = sglang.mod

    class BlockStored(mod.BlockStored, array_like=True):  # type: ignore[call-arg]
        pass

    class BlockRemoved(mod.BlockRemoved, array_like=True):  # type: ignore[call-arg]
        pass

    salted = BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=T[:32], block_size=16,
                         lora_id=None, medium="GPU", cache_salt="tenant-a")
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(salted))[:2] == ["BlockStored", [1, 2]]
    with Rig(env, sglang) as r:
        r.publish(salted)
        r.publish(BlockStored(block_hashes=[3], parent_block_hash=2, token_ids=T[32:48], block_size=16,
                              lora_id=None, medium="GPU", cache_salt="tenant-a"))
        r.publish(BlockStored(block_hashes=[7], parent_block_hash=None, token_ids=T[:16], block_size=16,
                              lora_id=4, medium=mod.StorageMedium.CPU.value, lora_name="ad"))
        r.sees(T, TierOverlap(device=3), cache_salt="tenant-a")
        r.sees(T, TierOverlap(host_pinned=1), lora_name="ad")
        r.publish(BlockRemoved(block_hashes=[3], medium="GPU"))
        r.sees(T, TierOverlap(device=2), cache_salt="tenant-a")
        assert r.overlap(T) == TierOverlap()
        assert not r.problems() and not r.node.consolidator.anomalies
