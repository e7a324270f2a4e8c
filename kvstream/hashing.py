"""Block hashing (DESIGN.md §1): local hashes of token blocks and chained sequence hashes.

A prompt is cut into full blocks of ``block_size`` u32 tokens (a trailing partial block
is dropped). A block's local hash is XXH3-64 of its tokens as little-endian u32, seeded
with 1337 (or the identity seed of a LoRA adapter and cache salt); sequence hashes chain
the local hashes so that equal sequence hashes mean equal prefixes.

Cache identity beyond tokens follows NVIDIA Dynamo's ``compute_block_hash_for_seq``
(``ai-dynamo-runtime``, checked against it in tests/test_hashing_dynamo.py): the LoRA
name and the cache salt (Dynamo's ``cache_namespace``) enter the seed; the multimodal
objects of a block (their u64 hashes, sorted) are appended to its token bytes as
little-endian u64; extra tokens of a block (vLLM's ``lookahead_token_ids``, Dynamo's
EAGLE window) are appended as u32 like its own tokens.

The compiled kernel (``kvstream._native``, Rust) hashes a whole prompt per call (the
package does not run without it: the codec and the index need it too); tests/hashing
checks it against the spec written out in Python.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache

import xxhash

from kvstream import _native

DEFAULT_BLOCK_SIZE = 16
#: Seed of local hashes without LoRA, and of the sequence-hash chain (always).
CHAIN_SEED = 1337
_U64 = (1 << 64) - 1
_TOKEN_ERROR = "token ids must be a sequence of integers in [0, 2**32)"

#: A list/tuple of ints, or any buffer of native u32 (numpy uint32, array('I')).
TokenIds = Sequence[int]


@lru_cache(maxsize=1024)
def identity_seed(lora_name: str | None = None, cache_salt: str | None = None) -> int:
    """Seed of local hashes for an adapter and a cache salt (Dynamo's salt hash: the
    adapter's XXH3 with seed 0 and the salt's with seed 1, added to 1337); an absent or
    empty name or salt adds nothing."""
    seed = CHAIN_SEED
    if lora_name:
        seed += xxhash.xxh3_64_intdigest(lora_name.encode("utf-8"), 0)
    if cache_salt:
        seed += xxhash.xxh3_64_intdigest(cache_salt.encode("utf-8"), 1)
    return seed & _U64


def lora_seed(lora_name: str | None) -> int:
    """Seed of local hashes for an adapter; no name (or an empty one) means no LoRA."""
    return identity_seed(lora_name, None)


@dataclass(frozen=True, slots=True)
class MmSpan:
    """A multimodal object (image, audio...) occupying ``length`` prompt positions from
    ``offset``: every block that overlaps it carries its hash (Dynamo's block_mm_infos)."""

    mm_hash: int
    offset: int
    length: int

    def __post_init__(self) -> None:
        if not 0 <= self.mm_hash <= _U64:
            raise ValueError(f"multimodal hash {self.mm_hash} is not a u64")
        if self.offset < 0 or self.length <= 0:
            raise ValueError(f"multimodal span at {self.offset} of length {self.length}: need offset >= 0, length > 0")


def block_mm_hashes(spans: Iterable[MmSpan], block_size: int) -> dict[int, list[int]]:
    """Block index → multimodal hashes of the objects overlapping that block."""
    _check_block_size(block_size)
    out: dict[int, list[int]] = {}
    for sp in spans:
        for b in range(sp.offset // block_size, (sp.offset + sp.length - 1) // block_size + 1):
            out.setdefault(b, []).append(sp.mm_hash)
    return out


def _check_block_size(block_size: int) -> None:
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")


def _token_bytes(tokens: TokenIds) -> bytes:
    try:
        return array("I", tokens).tobytes()
    except (OverflowError, TypeError):
        raise ValueError(_TOKEN_ERROR) from None


def _block_hashes(
    tokens: TokenIds, block_size: int, seed: int, with_sequence: bool
) -> tuple[list[int], list[int]]:
    try:
        return _native.block_hashes(tokens, block_size, seed, with_sequence)
    except (OverflowError, TypeError):
        raise ValueError(_TOKEN_ERROR) from None


def _with_extras(
    local: list[int],
    tokens: TokenIds,
    block_size: int,
    seed: int,
    mm: Mapping[int, Sequence[int]],
    extra_tokens: Sequence[Sequence[int] | None] | None,
) -> list[int]:
    """Rehash the blocks that carry multimodal hashes or extra tokens (the rare path;
    the kernel did the others)."""
    raw = _token_bytes(tokens)
    step = 4 * block_size
    digest = xxhash.xxh3_64_intdigest
    for i in range(len(local)):
        more = extra_tokens[i] if extra_tokens is not None and i < len(extra_tokens) else None
        objs = mm.get(i)
        if not more and not objs:
            continue
        data = raw[i * step : (i + 1) * step]
        if more:
            data += _token_bytes(more)
        if objs:
            data += array("Q", sorted(objs)).tobytes()
        local[i] = digest(data, seed)
    return local


def local_hashes(
    tokens: TokenIds,
    block_size: int = DEFAULT_BLOCK_SIZE,
    lora_name: str | None = None,
    *,
    cache_salt: str | None = None,
    mm: Iterable[MmSpan] | Mapping[int, Sequence[int]] | None = None,
    extra_tokens: Sequence[Sequence[int] | None] | None = None,
) -> list[int]:
    """Local hash of every full block of ``tokens``. ``mm``: multimodal spans (or
    block index → object hashes); ``extra_tokens``: per block, tokens beyond it that
    its identity includes."""
    seed = identity_seed(lora_name, cache_salt)
    local = _block_hashes(tokens, block_size, seed, False)[0]
    if mm or extra_tokens:
        per_block = mm if isinstance(mm, Mapping) else block_mm_hashes(mm or (), block_size)
        local = _with_extras(local, tokens, block_size, seed, per_block, extra_tokens)
    return local


def block_hashes(
    tokens: TokenIds,
    block_size: int = DEFAULT_BLOCK_SIZE,
    lora_name: str | None = None,
    *,
    cache_salt: str | None = None,
    mm: Iterable[MmSpan] | None = None,
) -> tuple[list[int], list[int]]:
    """``(local, sequence)`` hashes of every full block of ``tokens``."""
    if not cache_salt and not mm:
        return _block_hashes(tokens, block_size, lora_seed(lora_name), True)
    local = local_hashes(tokens, block_size, lora_name, cache_salt=cache_salt, mm=mm)
    return local, sequence_hashes(local)


def sequence_hashes(local: Sequence[int], parent: int | None = None) -> list[int]:
    """Chained sequence hashes of ``local``, continuing from ``parent`` when given."""
    try:
        return _native.sequence_hashes(local, parent)
    except (OverflowError, TypeError):
        raise ValueError("hashes must be integers in [0, 2**64)") from None
