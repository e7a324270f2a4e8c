"""Onboarding: prefix continuation G1 → G2 → G3, copies back into G1, exact bytes."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kvstream.events.model import Tier  # noqa: E402
from kvstream.worker.offload import OffloadEngine, OffloadOptions  # noqa: E402
from kvstream.worker.onboard import Onboarder  # noqa: E402
from kvstream.worker.source_events import SourceStored  # noqa: E402

from .conftest import chain, checksum, expected, put  # noqa: E402
from .counts import pinned  # noqa: E402

G1, G2, G3 = Tier.DEVICE, Tier.HOST_PINNED, Tier.DISK


def spread(pool, local, seq):
    """Blocks 0-1 on G1 (and below), 2-3 on G2 only, 4-5 on G3 only (and G2 for 4)."""
    engine = OffloadEngine(pool, OffloadOptions(batch_blocks=4, disk_min_seen=1))
    put(pool, local, seq)
    assert engine.wait_idle(10)
    engine.close()
    pool.device.remove(seq[2:])
    pool.host.remove([seq[5]])
    pool.disk.remove(seq[:4])
    assert pool.device.match(seq) == 2
    assert pool.host.match(seq, 2) == 3
    assert pool.disk.match(seq, 4) == 2


def test_onboard_continues_across_tiers(make_pool, sink):
    pool = make_pool(device=8, host=8, disk=8)
    local, seq = chain(6)
    spread(pool, local, seq)
    sink.take()
    result = Onboarder(pool, batch_blocks=2).onboard(seq + [12345])
    assert (result.device_blocks, result.host_blocks, result.disk_blocks) == (2, 3, 1)
    assert result.block_hashes == tuple(seq)
    assert result.tokens == 24 and (result.host_blocks + result.disk_blocks) * result.block_size == 16  # came back
    assert result.slots == tuple(pool.device.slot_of(h) for h in seq)
    for h in seq:
        assert checksum(pool.read_block(G1, h)) == expected(h)
        assert pool.device.info(h).pins == 1  # pinned for the caller
    # the onboarded blocks are reported on the device, as one chain under block 1
    assert sink.take() == [SourceStored(G1, 0, seq[1], tuple(seq[2:]), tuple(local[2:]))]
    assert pinned(pool, pool.host) == 0 and pinned(pool, pool.disk) == 0
    pool.device.unpin(seq)


def test_onboard_stops_at_a_gap(make_pool):
    pool = make_pool()
    local, seq = chain(6)
    spread(pool, local, seq)
    pool.host.remove([seq[3]])  # the G2 continuation stops at block 3; G3 does not hold it
    result = Onboarder(pool).onboard(seq)
    assert (result.device_blocks, result.host_blocks, result.disk_blocks) == (2, 1, 0)
    pool.device.unpin(result.block_hashes)


def test_onboard_takes_what_g1_can_hold(make_pool):
    pool = make_pool(device=6, host=8, disk=8)
    local, seq = chain(6)
    spread(pool, local, seq)
    pool.device.allocate(3)  # an engine holds 3 blocks: room for 1 more
    result = Onboarder(pool).onboard(seq)
    assert (result.device_blocks, result.host_blocks, result.disk_blocks) == (2, 1, 0)
    assert checksum(pool.read_block(G1, seq[2])) == expected(seq[2])
    pool.device.unpin(result.block_hashes)


def test_onboard_nothing(make_pool, sink):
    pool = make_pool()
    result = Onboarder(pool).onboard(chain(3)[1])
    assert result.block_hashes == () and result.tokens == 0 and sink.events == []


def test_round_trip_g1_g2_g3_g1_bytes_identical(make_pool):
    pool = make_pool(device=8, host=8, disk=8)
    local, seq = chain(8)
    engine = OffloadEngine(pool, OffloadOptions(batch_blocks=3, disk_min_seen=1))
    put(pool, local, seq)
    assert engine.wait_idle(10)
    engine.close()
    before = [checksum(pool.read_block(G3, h)) for h in seq]
    pool.device.remove(seq)
    pool.host.remove(seq)
    result = Onboarder(pool, batch_blocks=3).onboard(seq)
    assert result.disk_blocks == 8
    assert [checksum(pool.read_block(G1, h)) for h in seq] == before == [expected(h) for h in seq]
    pool.device.unpin(seq)


def test_onboarding_refreshes_the_copies_on_every_tier(make_pool, sink):
    """Onboarding from G2 is a use of the block: its G3 copy becomes the most recent on
    G3, so a fresh write to a full G3 evicts another block."""
    pool = make_pool(device=8, host=8, disk=2)
    local, seq = chain(1)
    other_local, other = chain(1, start=100)
    engine = OffloadEngine(pool, OffloadOptions(batch_blocks=4, disk_min_seen=1, inline=True))
    put(pool, local, seq)
    put(pool, other_local, other)  # written to G3 after seq: the more recent there
    engine.close()
    pool.device.remove(seq)
    Onboarder(pool).onboard(seq)
    pool.device.unpin(seq)
    sink.take()
    pool.disk.allocate(1)
    assert [e.block_hashes for e in sink.take()] == [(other[0],)]
