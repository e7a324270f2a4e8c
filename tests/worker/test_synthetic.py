"""Synthetic engine: the whole worker side with no model."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kvstream.hashing import block_hashes  # noqa: E402
from kvstream.worker.errors import PoolConfigError, PoolExhaustedError  # noqa: E402
from kvstream.worker.offload import OffloadOptions  # noqa: E402
from kvstream.worker.pool import PoolOptions  # noqa: E402
from kvstream.worker.source_events import SourceStored  # noqa: E402
from kvstream.worker.synthetic import (  # noqa: E402
    PromptSetOptions,
    SyntheticEngine,
    SyntheticWorker,
    SyntheticWorkerOptions,
    block_content,
    shared_prefix_prompts,
)

from .conftest import SMALL, checksum, expected  # noqa: E402
from .counts import allocated, pinned  # noqa: E402
from .test_offload import assert_consistent  # noqa: E402


def test_prompts_are_seeded_and_share_prefixes():
    options = PromptSetOptions(prompts=30, prefixes=3, prefix_blocks=4, suffix_blocks=1, block_size=4, seed=7)
    prompts = list(shared_prefix_prompts(options))
    assert prompts == list(shared_prefix_prompts(options))
    other = PromptSetOptions(prompts=30, prefixes=3, prefix_blocks=4, suffix_blocks=1, block_size=4, seed=8)
    assert prompts != list(shared_prefix_prompts(other))
    firsts = {tuple(p[:4]) for p in prompts}
    assert len(firsts) <= 3 and len(prompts) == 30  # every prompt starts with one of 3 prefixes
    assert all(len(p) % 4 == 0 and 8 <= len(p) <= 20 for p in prompts)
    with pytest.raises(PoolConfigError):
        PromptSetOptions(prompts=0)


def test_block_content_is_deterministic_per_hash():
    a = block_content(SMALL, 42).view(torch.uint8)
    assert torch.equal(a, block_content(SMALL, 42).view(torch.uint8))
    assert not torch.equal(a, block_content(SMALL, 43).view(torch.uint8))
    assert block_content(SMALL, 2**64 - 1).shape == SMALL.block_shape


def test_synthetic_worker_runs_every_tier(tmp_path, sink):
    options = SyntheticWorkerOptions(
        layout=SMALL,
        device_capacity=16,
        pool=PoolOptions(host_capacity=24, disk_capacity=48, disk_path=tmp_path / "g3.blocks"),
        offload=OffloadOptions(batch_blocks=4, queue_blocks=8),
        device="cpu",
        verify=True,
    )
    prompts = list(shared_prefix_prompts(PromptSetOptions(prompts=80, prefixes=6, prefix_blocks=6, suffix_blocks=1, block_size=4, seed=1)))
    worker = SyntheticWorker(options, sink)
    try:
        stats = worker.run(prompts)
        assert stats.prompts == 80
        assert stats.blocks == sum(len(p) // 4 for p in prompts)
        assert stats.blocks == stats.device_hits + stats.host_hits + stats.disk_hits + stats.computed
        assert stats.device_hits and stats.host_hits and stats.disk_hits, stats
        assert worker.offload.close().drained
        assert_consistent(worker.pool, sink)
    finally:
        worker.pool.close()
    first = next(e for e in sink.events if isinstance(e, SourceStored))
    local, seq = block_hashes(prompts[0], 4)
    assert first.block_hashes == tuple(seq) and first.tokens_hashes == tuple(local)


def test_prompt_larger_than_g1_fails_cleanly(make_pool, sink):
    pool = make_pool(device=2, disk=None)
    engine = SyntheticEngine(pool)
    with pytest.raises(PoolExhaustedError):
        engine.run_prompt(range(12))  # 3 blocks, G1 holds 2
    assert pinned(pool, pool.device) == 0 and allocated(pool, pool.device) == 0 and sink.events == []
    result = engine.run_prompt(range(8))
    assert (result.blocks, result.computed) == (2, 2)
    again = engine.run_prompt(range(8))
    assert (again.device_hits, again.computed) == (2, 0)
    local, seq = block_hashes(list(range(8)), 4)
    assert [checksum(pool.read_block(pool.device.tier, h)) for h in seq] == [expected(h) for h in seq]


def test_synthetic_worker_close_releases_the_disk_file(tmp_path, sink):
    path = tmp_path / "g3.blocks"
    options = SyntheticWorkerOptions(SMALL, 8, PoolOptions(host_capacity=8, disk_capacity=8, disk_path=path), device="cpu")
    with SyntheticWorker(options, sink) as worker:
        worker.run([list(range(8))])
        assert path.stat().st_size == 8 * SMALL.block_bytes
    assert worker.pool.host.match(block_hashes(list(range(8)), 4)[1]) == 2  # drained on close
    assert not path.exists()


@pytest.mark.parametrize("mode", ["dedup", "passthrough"])
def test_pool_events_apply_cleanly_in_the_consolidator(tmp_path, mode):
    """The real consolidator accepts every event of a busy pool: no store without its
    parent on the same tier, no remove of a block never stored, no repeated store."""
    from kvstream.worker.consolidator import Consolidator, Mode

    calls: list[str] = []

    class CountingWriter:
        def stored(self, dp_rank, tier, parent_hash, block_hashes, tokens_hashes) -> None:
            calls.append(f"stored:{tier.value}")

        def removed(self, dp_rank, tier, block_hashes) -> None:
            calls.append(f"removed:{tier.value}")

        def cleared(self, dp_rank, tier=None) -> None:
            calls.append("cleared")

    consolidator = Consolidator(CountingWriter(), Mode(mode))
    options = SyntheticWorkerOptions(
        layout=SMALL,
        device_capacity=16,
        pool=PoolOptions(host_capacity=20, disk_capacity=40, disk_path=tmp_path / "g3.blocks"),
        offload=OffloadOptions(batch_blocks=4, queue_blocks=8),
        device="cpu",
    )
    prompts = shared_prefix_prompts(PromptSetOptions(prompts=120, prefixes=8, prefix_blocks=6, suffix_blocks=2, block_size=4, seed=2))
    with SyntheticWorker(options, consolidator) as worker:
        stats = worker.run(prompts)
    assert stats.host_hits and stats.disk_hits
    assert consolidator.anomalies == {}, consolidator.anomalies
    tiers = {c.split(":")[1] for c in calls if c.startswith("removed")}
    assert tiers == ({"device"} if mode == "dedup" else {"device", "host_pinned", "disk"})
