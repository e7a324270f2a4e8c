"""Block hashing (DESIGN.md §1): local hashes of token blocks and chained sequence hashes.

A prompt is cut into full blocks of ``block_size`` u32 tokens (a trailing partial block
is dropped). A block's local hash is XXH3-64 of its tokens as little-endian u32, seeded
with 1337 (or the LoRA seed); sequence hashes chain the local hashes so that equal
sequence hashes mean equal prefixes.

The compiled kernel (``kvstream._native``, Rust) hashes a whole prompt per call; without
it the pure-Python definitions below are used, with identical results.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from functools import lru_cache

import xxhash

DEFAULT_BLOCK_SIZE = 16
#: Seed of local hashes without LoRA, and of the sequence-hash chain (always).
CHAIN_SEED = 1337
_U64 = (1 << 64) - 1
_TOKEN_ERROR = "token ids must be a sequence of integers in [0, 2**32)"

try:
    from kvstream import _native
except ImportError:  # source tree without the compiled kernel
    _native = None  # type: ignore[assignment]

#: True when the compiled kernel is in use.
HAVE_KERNEL = _native is not None

#: A list/tuple of ints, or any buffer of native u32 (numpy uint32, array('I')).
TokenIds = Sequence[int]


@lru_cache(maxsize=1024)
def lora_seed(lora_name: str | None) -> int:
    """Seed of local hashes for an adapter; no name (or an empty one) means no LoRA."""
    if not lora_name:
        return CHAIN_SEED
    return (CHAIN_SEED + xxhash.xxh3_64_intdigest(lora_name.encode("utf-8"), 0)) & _U64


def chain_hash(parent: int, local: int) -> int:
    """Sequence hash of a block whose parent has sequence hash ``parent``."""
    return xxhash.xxh3_64_intdigest(
        parent.to_bytes(8, "little") + local.to_bytes(8, "little"), CHAIN_SEED
    )


def _check_block_size(block_size: int) -> None:
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")


def _token_bytes(tokens: TokenIds) -> bytes:
    try:
        return array("I", tokens).tobytes()
    except (OverflowError, TypeError):
        raise ValueError(_TOKEN_ERROR) from None


def py_block_hashes(
    tokens: TokenIds, block_size: int, seed: int, with_sequence: bool
) -> tuple[list[int], list[int]]:
    """Pure-Python definition of the kernel's ``block_hashes`` (same results)."""
    _check_block_size(block_size)
    raw = _token_bytes(tokens)
    step = 4 * block_size
    digest = xxhash.xxh3_64_intdigest
    local = [digest(raw[i : i + step], seed) for i in range(0, len(raw) - step + 1, step)]
    return local, (py_sequence_hashes(local) if with_sequence else [])


def py_sequence_hashes(local: Iterable[int], parent: int | None = None) -> list[int]:
    """Pure-Python definition of the kernel's ``sequence_hashes``."""
    out: list[int] = []
    prev = parent
    for h in local:
        prev = h if prev is None else chain_hash(prev, h)
        out.append(prev)
    return out


def _block_hashes(
    tokens: TokenIds, block_size: int, seed: int, with_sequence: bool
) -> tuple[list[int], list[int]]:
    if _native is None:
        return py_block_hashes(tokens, block_size, seed, with_sequence)
    try:
        return _native.block_hashes(tokens, block_size, seed, with_sequence)
    except (OverflowError, TypeError):
        raise ValueError(_TOKEN_ERROR) from None


def local_hashes(
    tokens: TokenIds, block_size: int = DEFAULT_BLOCK_SIZE, lora_name: str | None = None
) -> list[int]:
    """Local hash of every full block of ``tokens``."""
    return _block_hashes(tokens, block_size, lora_seed(lora_name), False)[0]


def block_hashes(
    tokens: TokenIds, block_size: int = DEFAULT_BLOCK_SIZE, lora_name: str | None = None
) -> tuple[list[int], list[int]]:
    """``(local, sequence)`` hashes of every full block of ``tokens``."""
    return _block_hashes(tokens, block_size, lora_seed(lora_name), True)


def sequence_hashes(local: Sequence[int], parent: int | None = None) -> list[int]:
    """Chained sequence hashes of ``local``, continuing from ``parent`` when given."""
    if _native is None:
        return py_sequence_hashes(local, parent)
    try:
        return _native.sequence_hashes(local, parent)
    except (OverflowError, TypeError):
        raise ValueError("hashes must be integers in [0, 2**64)") from None
