"""Block hashing (DESIGN.md §1): the reference vectors, and the kernel == the spec in Python."""

from __future__ import annotations

import json
import random
import struct
from array import array

import numpy as np
import pytest
import xxhash
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstream import hashing
from kvstream.tools.hash_cmd import hash_cmd


def reference(tokens: list[int], block_size: int, seed: int) -> tuple[list[int], list[int]]:
    """Straight from the spec, one block at a time, no shared code with kvstream."""
    local = []
    for start in range(0, len(tokens) // block_size * block_size, block_size):
        raw = struct.pack(f"<{block_size}I", *tokens[start : start + block_size])
        local.append(xxhash.xxh3_64_intdigest(raw, seed))
    return local, reference_chain(local)


def reference_chain(local: list[int], parent: int | None = None) -> list[int]:
    """Sequence hashes from the spec: XXH3 of (parent, local) as little-endian u64, seed 1337."""
    seq: list[int] = []
    prev = parent
    for h in local:
        prev = h if prev is None else xxhash.xxh3_64_intdigest(struct.pack("<QQ", prev, h), 1337)
        seq.append(prev)
    return seq


def test_xxh3_vector() -> None:
    assert xxhash.xxh3_64_intdigest(b"test data", 1337) == 13226331709069118873


def test_local_and_sequence_vectors() -> None:
    local, seq = hashing.block_hashes(list(range(32)))
    assert local == [15310707395893867146, 15292316782987903195]
    assert seq[0] == local[0]
    assert seq[1] == 13769157705258532664


def test_lora_vectors() -> None:
    assert hashing.lora_seed("my-lora") == 12827409268353072861
    assert hashing.local_hashes(list(range(16)), lora_name="my-lora") == [7774427462321301335]
    # An empty name is no LoRA; the chain keeps seed 1337 under a LoRA.
    assert hashing.lora_seed("") == hashing.lora_seed(None) == 1337
    local, seq = hashing.block_hashes(list(range(32)), lora_name="my-lora")
    assert seq == reference_chain(local)


def test_partial_block_dropped_and_empty() -> None:
    assert hashing.block_hashes(list(range(31))) == (
        [15310707395893867146],
        [15310707395893867146],
    )
    assert hashing.block_hashes([]) == ([], [])


tokens_st = st.lists(st.integers(0, 2**32 - 1), max_size=200)


@settings(max_examples=300, deadline=None)
@given(tokens=tokens_st, block_size=st.integers(1, 40), lora=st.one_of(st.none(), st.text(max_size=8)))
def test_matches_reference(tokens: list[int], block_size: int, lora: str | None) -> None:
    seed = hashing.lora_seed(lora)
    expected = reference(tokens, block_size, seed)
    assert hashing.block_hashes(tokens, block_size, lora) == expected
    assert hashing.local_hashes(tokens, block_size, lora) == expected[0]


@settings(max_examples=100, deadline=None)
@given(local=st.lists(st.integers(0, 2**64 - 1), max_size=50), parent=st.one_of(st.none(), st.integers(0, 2**64 - 1)))
def test_sequence_hashes_continue_from_parent(local: list[int], parent: int | None) -> None:
    assert hashing.sequence_hashes(local, parent) == reference_chain(local, parent)
    if parent is None and local:
        # Continuing a chain from its k-th hash gives the rest of it.
        full = hashing.sequence_hashes(local)
        k = len(local) // 2
        assert hashing.sequence_hashes(local[k + 1 :], full[k]) == full[k + 1 :]


def test_buffer_inputs_equal_list_input() -> None:
    tokens = [random.Random(1).randrange(2**32) for _ in range(8192)]
    expected = hashing.block_hashes(tokens)
    assert hashing.block_hashes(array("I", tokens)) == expected
    assert hashing.block_hashes(np.asarray(tokens, dtype=np.uint32)) == expected
    assert hashing.block_hashes(tuple(tokens)) == expected


@pytest.mark.parametrize("bad", [[-1], [2**32], [1.5], ["a"], [None], "abc"])
def test_bad_tokens_raise_value_error(bad: object) -> None:
    with pytest.raises(ValueError, match="token ids"):
        hashing.block_hashes(bad)  # type: ignore[arg-type]


def test_bad_block_size() -> None:
    with pytest.raises(ValueError, match="block_size"):
        hashing.block_hashes([1, 2, 3], 0)


def test_hash_command(tmp_path) -> None:
    runner = CliRunner()
    out = runner.invoke(hash_cmd, [str(t) for t in range(32)])
    assert out.exit_code == 0, out.output
    assert json.loads(out.output) == {
        "block_size": 16,
        "local": [15310707395893867146, 15292316782987903195],
        "sequence": [15310707395893867146, 13769157705258532664],
    }
    f = tmp_path / "t.json"
    f.write_text(json.dumps(list(range(16))))
    out = runner.invoke(hash_cmd, ["--tokens-file", str(f), "--lora", "my-lora", "--block-size", "16"])
    assert json.loads(out.output)["local"] == [7774427462321301335]
    f.write_text('{"not": "a list"}')
    out = runner.invoke(hash_cmd, ["--tokens-file", str(f)])
    assert out.exit_code == 2 and "JSON array" in out.output
    out = runner.invoke(hash_cmd, ["--", "-5"])
    assert out.exit_code == 2 and "token ids" in out.output
