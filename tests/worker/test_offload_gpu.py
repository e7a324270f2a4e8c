"""The CUDA paths: G1 on the GPU, pinned G2, the offload stream and its events.
Skipped where no GPU is present (ops/gpu-check.sh runs them on a CUDA machine)."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

from kvstream.events.model import Tier  # noqa: E402
from kvstream.worker.layout import TensorBlocks, copy_down, copy_up  # noqa: E402
from kvstream.worker.offload import OffloadEngine, OffloadOptions  # noqa: E402
from kvstream.worker.onboard import Onboarder  # noqa: E402
from kvstream.worker.pool import NewBlock, PoolOptions, TieredBlockPool  # noqa: E402
from kvstream.worker.synthetic import SyntheticEngine, block_content  # noqa: E402

from .conftest import SMALL, chain, checksum, expected, put, requires_cuda  # noqa: E402
from .test_offload import assert_consistent  # noqa: E402

pytestmark = [pytest.mark.gpu, requires_cuda]

G1, G2, G3 = Tier.DEVICE, Tier.HOST_PINNED, Tier.DISK


def test_cuda_pool_is_on_the_gpu_with_pinned_host(make_pool):
    pool = make_pool(device_type="cuda")
    assert pool.device_store.device.type == "cuda"
    assert pool.host_store.pinned


def test_scattered_slots_through_device_staging():
    host = TensorBlocks(SMALL, 8, torch.device("cpu"), pin=True)
    dev = TensorBlocks(SMALL, 8, torch.device("cuda"))
    for s in range(8):
        dev.data[s].copy_(block_content(SMALL, s))
    staging = torch.empty((4, *SMALL.block_shape), dtype=SMALL.dtype, device="cuda")
    copy_down(dev, [7, 2, 5, 0], host, [1, 2, 6, 4], staging)
    torch.cuda.synchronize()
    for src, dst in [(7, 1), (2, 2), (5, 6), (0, 4)]:
        assert torch.equal(host.data[dst].view(torch.uint8), block_content(SMALL, src).view(torch.uint8))
    back = TensorBlocks(SMALL, 8, torch.device("cuda"))
    copy_up(host, [1, 2, 6, 4], back, [3, 0, 7, 5], staging)
    torch.cuda.synchronize()
    for src, dst in [(7, 3), (2, 0), (5, 7), (0, 5)]:
        assert torch.equal(back.data[dst].cpu().view(torch.uint8), block_content(SMALL, src).view(torch.uint8))


def test_offload_waits_for_writes_on_the_registering_stream(make_pool, sink):
    pool = make_pool(device_type="cuda")
    engine = OffloadEngine(pool, OffloadOptions(batch_blocks=4))
    local, seq = chain(4)
    contents = [block_content(SMALL, h).cuda() for h in seq]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    slots = pool.device.allocate(4)
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # keeps the copies below queued after register returns
        for s, content in zip(slots, contents):
            pool.device_store.data[s].copy_(content, non_blocking=True)
        pool.device.register([NewBlock(s, seq[i], seq[i - 1] if i else None, local[i]) for i, s in enumerate(slots)], pin=False)
    assert engine.wait_idle(30)
    assert [checksum(pool.read_block(G2, h)) for h in seq] == [expected(h) for h in seq]
    engine.close()


def test_cuda_round_trip_g1_g2_g3_g1(make_pool, sink):
    pool = make_pool(device=8, host=8, disk=8, device_type="cuda")
    local, seq = chain(8)
    engine = OffloadEngine(pool, OffloadOptions(batch_blocks=3, disk_min_seen=1))
    put(pool, local, seq)
    assert engine.wait_idle(30)
    engine.close()
    pool.device.remove(seq)
    pool.host.remove(seq[4:])
    result = Onboarder(pool, batch_blocks=3).onboard(seq)
    assert (result.host_blocks, result.disk_blocks) == (4, 4)
    assert [checksum(pool.read_block(G1, h)) for h in seq] == [expected(h) for h in seq]
    pool.device.unpin(seq)
    assert_consistent(pool, sink)


def test_cuda_synthetic_engine_under_eviction(make_pool, sink):
    pool = make_pool(device=8, host=10, disk=16, device_type="cuda")
    offload = OffloadEngine(pool, OffloadOptions(batch_blocks=3, queue_blocks=4, inflight_batches=2))
    engine = SyntheticEngine(pool, offload, verify=True)
    rng = random.Random(3)
    for _ in range(60):
        start = 100 * rng.randrange(10)
        engine.run_prompt(range(start, start + 8))
    assert engine.stats.host_hits and engine.stats.disk_hits, engine.stats
    assert offload.close().drained
    assert_consistent(pool, sink)


def test_adopted_cuda_kv_cache_round_trip(tmp_path, sink):
    kv = [torch.zeros((2, 8, 4, 2, 8), dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    options = PoolOptions(host_capacity=8, disk_capacity=8, disk_path=tmp_path / "g3.blocks")
    pool = TieredBlockPool.adopt(kv, options, sink)
    try:
        local, seq = chain(5)
        engine = OffloadEngine(pool, OffloadOptions(batch_blocks=2, disk_min_seen=1))
        put(pool, local, seq)
        assert engine.wait_idle(30)
        engine.close()
        pool.device.remove(seq)
        pool.host.remove(seq[2:])
        result = Onboarder(pool, batch_blocks=2).onboard(seq)
        assert (result.host_blocks, result.disk_blocks) == (2, 3)
        assert [checksum(pool.read_block(G1, h)) for h in seq] == [expected(h) for h in seq]
        pool.device.unpin(seq)
    finally:
        pool.close()
