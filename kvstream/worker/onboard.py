"""Onboarding (DESIGN.md §8): bring a prompt's cached prefix back into G1.

The prefix is matched contiguously in G1, continued in G2, then in G3. Blocks found below
G1 are copied into freshly allocated G1 blocks (G3 blocks through a host staging buffer,
read with one scattered read per run of consecutive G3 slots) and registered there. The
whole prefix comes back pinned on G1 for the caller, who unpins it when the request ends.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvstream.worker.errors import PoolConfigError
from kvstream.worker.layout import TensorBlocks, copy_up
from kvstream.worker.pool import BlockInfo, BlockTier, NewBlock, TieredBlockPool


@dataclass(frozen=True, slots=True)
class OnboardResult:
    #: The matched prefix, now all on G1 and pinned there for the caller.
    block_hashes: tuple[int, ...]
    #: Their G1 slots.
    slots: tuple[int, ...]
    device_blocks: int
    host_blocks: int
    disk_blocks: int
    block_size: int

    @property
    def tokens(self) -> int:
        """Tokens of the prompt whose KV is now on G1."""
        return len(self.block_hashes) * self.block_size


class Onboarder:
    """Copies prefixes back into G1; one onboarding at a time (they share staging)."""

    def __init__(self, pool: TieredBlockPool, batch_blocks: int = 16) -> None:
        if batch_blocks <= 0:
            raise PoolConfigError(f"batch_blocks must be positive, got {batch_blocks}")
        self.pool = pool
        self.batch_blocks = batch_blocks
        self._lock = threading.Lock()
        dev = pool.device_store.device
        cuda = dev.type == "cuda"
        self._stream = torch.cuda.Stream(device=dev) if cuda else None
        self._dev_staging = (
            torch.empty((batch_blocks, *pool.layout.block_shape), dtype=pool.layout.dtype, device=dev)
            if cuda
            else None
        )
        # Two host staging buffers for G3 reads: the disk fills one while the other crosses to the GPU.
        self._host_staging: list[TensorBlocks] = []
        self._staged: list[torch.cuda.Event | None] = [None, None]
        if pool.disk is not None:
            self._host_staging = [
                TensorBlocks(pool.layout, batch_blocks, torch.device("cpu"), pin=pool.host_store.pinned)
                for _ in range(2 if cuda else 1)
            ]

    def onboard(self, block_hashes: Sequence[int], priority: int = 0) -> OnboardResult:
        """Match ``block_hashes`` (a prompt's sequence hashes) across the tiers and copy
        the lower-tier part of the prefix into G1. As many blocks as G1 can take are
        onboarded; the result says how many came from where."""
        pool = self.pool
        hashes = list(block_hashes)
        with pool.locked():
            n1 = pool.device.match(hashes)
            pool.device.pin(hashes[:n1], hit=True)
            n2 = pool.host.match(hashes, n1)
            n3 = pool.disk.match(hashes, n1 + n2) if pool.disk is not None else 0
            dst = pool.device.allocate(n2 + n3, partial=True)
            # G1 may take fewer blocks than found: keep the leading part of the continuation.
            n2 = min(n2, len(dst))
            n3 = len(dst) - n2
            host_part = hashes[n1 : n1 + n2]
            disk_part = hashes[n1 + n2 : n1 + n2 + n3]
            # Onboarding is a hit on the lower tiers: their copies elsewhere become recent too.
            pool.host.pin(host_part, hit=True)
            if pool.disk is not None:
                pool.disk.pin(disk_part, hit=True)
            host_infos = [self._info(pool.host, h) for h in host_part]
            disk_infos = [self._info(pool.disk, h) for h in disk_part] if disk_part else []
        try:
            with self._lock:
                if self._stream is not None:
                    # Freed G1 slots may still be read by kernels queued on the engine's stream.
                    self._stream.wait_stream(torch.cuda.current_stream(pool.device_store.device))
                self._copy_host(host_infos, dst[:n2])
                self._copy_disk(disk_infos, dst[n2:])
                if self._stream is not None:
                    self._stream.synchronize()
        except BaseException:
            with pool.locked():
                pool.device.free(dst)
                pool.device.unpin(hashes[:n1])
                pool.host.unpin(host_part)
                if pool.disk is not None:
                    pool.disk.unpin(disk_part)
            raise
        with pool.locked():
            new = [
                NewBlock(slot, i.block_hash, i.parent_hash, i.tokens_hash)
                for slot, i in zip(dst, host_infos + disk_infos)
            ]
            slots = pool.device.register(new, priority=priority, pin=True)
            pool.host.unpin(host_part)
            if pool.disk is not None:
                pool.disk.unpin(disk_part)
            prefix_slots = [pool.device.slot_of(h) for h in hashes[:n1]]
        return OnboardResult(
            block_hashes=tuple(hashes[: n1 + n2 + n3]),
            slots=tuple(prefix_slots + slots),
            device_blocks=n1,
            host_blocks=n2,
            disk_blocks=n3,
            block_size=pool.layout.block_size,
        )

    @staticmethod
    def _info(tier: BlockTier | None, block_hash: int) -> BlockInfo:
        info = tier.info(block_hash) if tier is not None else None
        assert info is not None  # matched and pinned under the same lock hold
        return info

    def _copy_host(self, infos: list[BlockInfo], dst: list[int]) -> None:
        pool = self.pool
        for k in range(0, len(infos), self.batch_blocks):
            src = [i.slot for i in infos[k : k + self.batch_blocks]]
            self._up(pool.host_store, src, dst[k : k + self.batch_blocks])

    def _copy_disk(self, infos: list[BlockInfo], dst: list[int]) -> None:
        disk_store = self.pool.disk_store
        for n, k in enumerate(range(0, len(infos), self.batch_blocks)):
            assert disk_store is not None
            chunk = infos[k : k + self.batch_blocks]
            buf = n % len(self._host_staging)
            staged = self._staged[buf]
            if staged is not None:
                staged.synchronize()  # this buffer's previous copy to the GPU is done
            staging = self._host_staging[buf]
            rows = staging.byte_rows().numpy()
            disk_store.read([i.slot for i in chunk], [rows[j] for j in range(len(chunk))])
            self._staged[buf] = self._up(staging, list(range(len(chunk))), dst[k : k + self.batch_blocks])

    def _up(self, src: TensorBlocks, src_slots: list[int], dst: list[int]) -> torch.cuda.Event | None:
        if self._stream is None:
            copy_up(src, src_slots, self.pool.device_store, dst, None)
            return None
        with torch.cuda.stream(self._stream):
            copy_up(src, src_slots, self.pool.device_store, dst, self._dev_staging)
            return self._stream.record_event()
