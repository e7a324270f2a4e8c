"""``kvstream bench hashing``: µs to hash an 8k-token prompt, against the per-block loop."""

from __future__ import annotations

import random
from array import array

import click
import xxhash

from kvstream import hashing
from bench.common import best_of, emit, json_option


def per_block_loop(tokens: list[int], block_size: int, seed: int, with_sequence: bool) -> tuple[list[int], list[int]]:
    """The baseline: the hashes written as a plain loop, one xxhash call per block and
    one per block for the chain (DESIGN.md §1)."""
    raw = array("I", tokens).tobytes()
    step = 4 * block_size
    digest = xxhash.xxh3_64_intdigest
    local = [digest(raw[i : i + step], seed) for i in range(0, len(raw) - step + 1, step)]
    seq: list[int] = []
    if with_sequence:
        prev: int | None = None
        for h in local:
            prev = h if prev is None else digest(prev.to_bytes(8, "little") + h.to_bytes(8, "little"), hashing.CHAIN_SEED)
            seq.append(prev)
    return local, seq


@click.command("hashing")
@click.option("--tokens", "n_tokens", default=8192, show_default=True, help="Prompt length.")
@click.option("--block-size", default=16, show_default=True)
@click.option("--vocab", default=152_064, show_default=True, help="Token ids are drawn below this (a real tokenizer's vocabulary size).")
@click.option("--seed", default=0, show_default=True)
@json_option
def hashing_bench(n_tokens: int, block_size: int, vocab: int, seed: int, as_json: bool) -> None:
    """Local + sequence hashes of one prompt given as a list of ints (as requests carry
    it). The baseline is the plain per-block xxhash loop (:func:`per_block_loop`)."""
    rng = random.Random(seed)
    tokens = [rng.randrange(vocab) for _ in range(n_tokens)]
    buffer = array("I", tokens)
    seed_ = hashing.CHAIN_SEED
    if hashing.block_hashes(tokens, block_size) != per_block_loop(tokens, block_size, seed_, True):
        raise click.ClickException("kernel and per-block loop hashes differ")
    ours = best_of(lambda: hashing.block_hashes(tokens, block_size), 300)
    from_buffer = best_of(lambda: hashing.block_hashes(buffer, block_size), 300)
    local_only = best_of(lambda: hashing.local_hashes(tokens, block_size), 300)
    base = best_of(lambda: per_block_loop(tokens, block_size, seed_, True), 50)
    base_local = best_of(lambda: per_block_loop(tokens, block_size, seed_, False), 50)
    emit(
        {
            "bench": "hashing",
            "tokens": n_tokens,
            "vocab": vocab,
            "block_size": block_size,
            "kernel": "native",
            "us_per_prompt": round(ours * 1e6, 2),
            "baseline_us_per_prompt": round(base * 1e6, 2),
            "speedup": round(base / ours, 2),
            "us_per_prompt_from_u32_buffer": round(from_buffer * 1e6, 2),
            "local_only_us_per_prompt": round(local_only * 1e6, 2),
            "local_only_baseline_us_per_prompt": round(base_local * 1e6, 2),
        },
        as_json,
    )
