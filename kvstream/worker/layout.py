"""Block layout and in-memory block storage (DESIGN.md §8).

A KV block is ``num_layers × (K, V) × block_size × kv_heads × head_dim`` values of one
dtype. The pool copies whole blocks. Storage comes in two shapes:

- ``TensorBlocks``: one contiguous tensor ``[capacity, *block_shape]`` (the pool's own G1,
  and G2); a run of consecutive slots is one contiguous region, so it copies in one call.
- ``LayerwiseBlocks``: an engine's per-layer KV tensors ``[2, num_blocks, block_size,
  kv_heads, head_dim]`` adopted as G1 (vLLM's layout); a block is spread over the layers.

``copy_down`` / ``copy_up`` move a batch between a G1 storage and a host ``TensorBlocks``:
copies are grouped into runs of consecutive host slots, and when G1 is on a GPU the
scattered side is gathered/scattered on the device through a staging buffer, so that each
host run crosses the bus in one copy.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from kvstream.worker.errors import LayoutError, PoolConfigError


@dataclass(frozen=True, slots=True)
class BlockLayout:
    """Shape and dtype of one KV block."""

    num_layers: int
    block_size: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float16

    def __post_init__(self) -> None:
        for name in ("num_layers", "block_size", "kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise LayoutError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.dtype, torch.dtype):
            raise LayoutError(f"dtype must be a torch.dtype, got {self.dtype!r}")

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.block_size, self.kv_heads, self.head_dim)

    @property
    def block_numel(self) -> int:
        return self.num_layers * 2 * self.block_size * self.kv_heads * self.head_dim

    @property
    def block_bytes(self) -> int:
        return self.block_numel * self.dtype.itemsize

    def check_block(self, block: torch.Tensor) -> None:
        """Raise LayoutError unless ``block`` is one block of this layout."""
        if block.dtype != self.dtype:
            raise LayoutError(f"block dtype {block.dtype} differs from the layout's {self.dtype}")
        if tuple(block.shape) != self.block_shape:
            raise LayoutError(
                f"block shape {tuple(block.shape)} differs from the layout's {self.block_shape}"
            )


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b|b)\s*$", re.IGNORECASE)


def capacity_blocks(capacity: int | str, layout: BlockLayout, what: str) -> int:
    """Blocks in a tier of ``capacity``: an int is a block count, a string a byte size
    such as ``"512MiB"`` or ``"2GB"`` (rounded down to whole blocks)."""
    if isinstance(capacity, bool):
        raise PoolConfigError(f"{what} capacity must be a block count or a byte size")
    if isinstance(capacity, int):
        blocks = capacity
    elif isinstance(capacity, str):
        m = _SIZE.match(capacity)
        if m is None:
            raise PoolConfigError(
                f"{what} capacity {capacity!r} is not a byte size like '512MiB' or '2GB'"
            )
        blocks = int(float(m.group(1)) * _UNITS[m.group(2).lower()]) // layout.block_bytes
    else:
        raise PoolConfigError(f"{what} capacity must be a block count or a byte size")
    if blocks <= 0:
        raise PoolConfigError(
            f"{what} capacity {capacity!r} holds no block of {layout.block_bytes} bytes"
        )
    return blocks


def runs(slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive slots: ``(index_in_slots, first_slot, length)``."""
    out: list[tuple[int, int, int]] = []
    i = 0
    n = len(slots)
    while i < n:
        j = i + 1
        while j < n and slots[j] == slots[j - 1] + 1:
            j += 1
        out.append((i, slots[i], j - i))
        i = j
    return out


class DeviceStorage(Protocol):
    """G1 block storage: the pool's own tensor or an engine's adopted per-layer tensors."""

    layout: BlockLayout
    capacity: int
    device: torch.device

    def gather(self, slots: Sequence[int], out: torch.Tensor) -> None:
        """Copy blocks ``slots`` into ``out[:len(slots)]`` (same device, block-shaped rows)."""
        ...

    def scatter(self, slots: Sequence[int], src: torch.Tensor) -> None:
        """Copy ``src[:len(slots)]`` into blocks ``slots`` (same device)."""
        ...


class TensorBlocks:
    """Blocks as rows of one contiguous tensor ``[capacity, *block_shape]``."""

    def __init__(self, layout: BlockLayout, capacity: int, device: torch.device, pin: bool = False) -> None:
        if capacity <= 0:
            raise PoolConfigError(f"capacity must be positive, got {capacity}")
        self.layout = layout
        self.capacity = capacity
        self.device = device
        self.data = torch.empty(
            (capacity, *layout.block_shape),
            dtype=layout.dtype,
            device=device,
            pin_memory=pin and device.type == "cpu",
        )

    @property
    def pinned(self) -> bool:
        return self.data.is_pinned()

    def gather(self, slots: Sequence[int], out: torch.Tensor) -> None:
        for i, first, n in runs(slots):
            out[i : i + n].copy_(self.data[first : first + n], non_blocking=True)

    def scatter(self, slots: Sequence[int], src: torch.Tensor) -> None:
        for i, first, n in runs(slots):
            self.data[first : first + n].copy_(src[i : i + n], non_blocking=True)

    def byte_rows(self) -> torch.Tensor:
        """``[capacity, block_bytes]`` uint8 view of the same memory (for file I/O)."""
        return self.data.view(torch.uint8).reshape(self.capacity, self.layout.block_bytes)


class LayerwiseBlocks:
    """An engine's KV cache adopted as G1: one ``[2, num_blocks, block_size, kv_heads,
    head_dim]`` tensor per layer, all of one dtype on one device."""

    def __init__(self, kv_caches: Sequence[torch.Tensor]) -> None:
        if not kv_caches:
            raise LayoutError("no KV tensors to adopt")
        first = kv_caches[0]
        if first.dim() != 5 or first.shape[0] != 2:
            raise LayoutError(
                "adopted KV tensors must be [2, num_blocks, block_size, kv_heads, head_dim], "
                f"got {tuple(first.shape)}"
            )
        for i, t in enumerate(kv_caches):
            if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
                raise LayoutError(
                    f"KV tensor of layer {i} is {tuple(t.shape)} {t.dtype} on {t.device}; "
                    f"layer 0 is {tuple(first.shape)} {first.dtype} on {first.device}"
                )
        _, num_blocks, block_size, kv_heads, head_dim = first.shape
        self.layout = BlockLayout(len(kv_caches), block_size, kv_heads, head_dim, first.dtype)
        self.capacity = num_blocks
        self.device = first.device
        self.layers = list(kv_caches)

    def gather(self, slots: Sequence[int], out: torch.Tensor) -> None:
        for i, first, n in runs(slots):
            for layer, kv in enumerate(self.layers):
                out[i : i + n, layer].copy_(kv[:, first : first + n].transpose(0, 1), non_blocking=True)

    def scatter(self, slots: Sequence[int], src: torch.Tensor) -> None:
        for i, first, n in runs(slots):
            for layer, kv in enumerate(self.layers):
                kv[:, first : first + n].copy_(src[i : i + n, layer].transpose(0, 1), non_blocking=True)


def copy_down(
    src: DeviceStorage,
    src_slots: Sequence[int],
    dst: TensorBlocks,
    dst_slots: Sequence[int],
    staging: torch.Tensor | None,
) -> None:
    """Copy G1 blocks into host blocks, on the current stream. ``staging`` (on the G1
    device, at least ``len(src_slots)`` rows) is needed when G1 is not host memory."""
    same = src.device == dst.device
    if not same and (staging is None or staging.shape[0] < len(src_slots)):
        raise LayoutError("a device-side staging buffer of the batch size is needed")
    for i, first, n in runs(dst_slots):
        target = dst.data[first : first + n]
        if same:
            src.gather(src_slots[i : i + n], target)
        else:
            assert staging is not None
            src.gather(src_slots[i : i + n], staging[i : i + n])
            target.copy_(staging[i : i + n], non_blocking=True)


def copy_up(
    src: TensorBlocks,
    src_slots: Sequence[int],
    dst: DeviceStorage,
    dst_slots: Sequence[int],
    staging: torch.Tensor | None,
) -> None:
    """Copy host blocks into G1 blocks, on the current stream (mirror of ``copy_down``)."""
    same = src.device == dst.device
    if not same and (staging is None or staging.shape[0] < len(src_slots)):
        raise LayoutError("a device-side staging buffer of the batch size is needed")
    for i, first, n in runs(src_slots):
        source = src.data[first : first + n]
        if same:
            dst.scatter(dst_slots[i : i + n], source)
        else:
            assert staging is not None
            staging[i : i + n].copy_(source, non_blocking=True)
            dst.scatter(dst_slots[i : i + n], staging[i : i + n])
