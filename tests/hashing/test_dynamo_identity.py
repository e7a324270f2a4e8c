"""kvstream's block hashes against NVIDIA Dynamo's own function (PyPI ai-dynamo-runtime):
plain, LoRA, cache salt (Dynamo's cache_namespace), multimodal objects, EAGLE windows,
and the `kvstream hash` command with --salt and --mm."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstream.hashing import MmSpan, block_hashes, block_mm_hashes, local_hashes
from kvstream.tools.hash_cmd import hash_cmd

dynamo_llm = pytest.importorskip("dynamo.llm", reason="ai-dynamo-runtime (a test dependency) is not installed")
dynamo_hash = dynamo_llm.compute_block_hash_for_seq

U64 = (1 << 64) - 1
names = st.none() | st.text(max_size=12)
block_sizes = st.sampled_from([1, 2, 4, 16, 32, 64])


@st.composite
def prompts(draw):  # type: ignore[no-untyped-def]
    bs = draw(block_sizes)
    tokens = draw(st.lists(st.integers(0, (1 << 32) - 1), max_size=6 * bs + bs - 1))
    spans = draw(
        st.lists(
            st.builds(
                MmSpan,
                st.integers(0, U64),
                st.integers(0, max(len(tokens) - 1, 0)),
                st.integers(1, 3 * bs),
            ),
            max_size=4,
        )
    )
    return tokens, bs, spans


def dynamo_mm_infos(spans: list[MmSpan], n_blocks: int, bs: int) -> list[dict | None] | None:
    if not spans:
        return None
    per_block = block_mm_hashes(spans, bs)
    return [
        {"mm_objects": [{"mm_hash": h, "offsets": []} for h in per_block[i]]} if i in per_block else None
        for i in range(n_blocks)
    ]


@settings(max_examples=400, deadline=None)
@given(prompts(), names, names)
def test_local_hashes_equal_dynamo(prompt, lora, salt) -> None:  # type: ignore[no-untyped-def]
    tokens, bs, spans = prompt
    n = len(tokens) // bs
    ours = local_hashes(tokens, bs, lora, cache_salt=salt, mm=spans)
    theirs = dynamo_hash(tokens, bs, dynamo_mm_infos(spans, n, bs), lora_name=lora, cache_namespace=salt)
    assert ours == theirs


@settings(max_examples=100, deadline=None)
@given(prompts(), names)
def test_eagle_windows_equal_dynamo(prompt, salt) -> None:  # type: ignore[no-untyped-def]
    # vLLM's lookahead_token_ids with one token per block is Dynamo's EAGLE window.
    tokens, bs, _ = prompt
    n = max(len(tokens) - 1, 0) // bs
    extra = [[tokens[(i + 1) * bs]] for i in range(n)]
    ours = local_hashes(tokens[: n * bs], bs, cache_salt=salt, extra_tokens=extra)
    assert ours == dynamo_hash(tokens, bs, None, is_eagle=True, cache_namespace=salt)


def test_plain_path_unchanged_on_many_random_blocks() -> None:
    import random

    rng = random.Random(7)
    tokens = [rng.getrandbits(32) for _ in range(16 * 20_000)]
    assert local_hashes(tokens, 16) == dynamo_hash(tokens, 16)
    assert local_hashes(tokens, 16, "adapter") == dynamo_hash(tokens, 16, lora_name="adapter")


@settings(max_examples=50, deadline=None)
@given(prompts(), names, names)
def test_hash_command_equals_dynamo(prompt, lora, salt) -> None:  # type: ignore[no-untyped-def]
    tokens, bs, spans = prompt
    args = ["--block-size", str(bs)]
    if lora is not None:
        args += ["--lora", lora]
    if salt is not None:
        args += ["--salt", salt]
    for sp in spans:
        args += ["--mm", f"{sp.mm_hash}:{sp.offset}:{sp.length}"]
    result = CliRunner().invoke(hash_cmd, [*args, "--", *map(str, tokens)])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    n = len(tokens) // bs
    assert out["local"] == dynamo_hash(tokens, bs, dynamo_mm_infos(spans, n, bs), lora_name=lora or None, cache_namespace=salt or None)
    assert (out["local"], out["sequence"]) == block_hashes(tokens, bs, lora, cache_salt=salt, mm=spans)


def test_bad_mm_span_is_a_clear_error() -> None:
    result = CliRunner().invoke(hash_cmd, ["--mm", "1:0:0", "1", "2"])
    assert result.exit_code != 0 and "length > 0" in result.output


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.integers(0, (1 << 32) - 1), min_size=16, max_size=80),
    st.none() | st.text(alphabet="abcxyz-", min_size=1, max_size=8),
    st.lists(st.none() | st.binary(min_size=1, max_size=4), max_size=5),
)
def test_engine_identity_fields_fold_as_dynamo(tokens, salt, images) -> None:  # type: ignore[no-untyped-def]
    """vLLM's extra_keys (a salt in the first block, (digest, offset) pairs) and
    SGLang's cache_salt give the local hashes Dynamo computes from the same facts."""
    import hashlib

    from kvstream.worker.engine_events import EventConverter, Flavour

    bs = 16
    n = len(tokens) // bs
    tokens = tokens[: n * bs]
    digests = [None if i >= len(images) or images[i] is None else hashlib.sha256(images[i]).hexdigest() for i in range(n)]
    extra = []
    for i in range(n):
        keys = ((salt,) if i == 0 and salt else ()) + (((digests[i], 3),) if digests[i] else ())
        extra.append(keys or None)
    base = {"type": "BlockStored", "block_hashes": list(range(1, n + 1)), "parent_block_hash": None,
            "token_ids": tokens, "block_size": bs, "lora_id": None, "medium": "GPU", "lora_name": None}
    infos = [{"mm_objects": [{"mm_hash": int(d[:16], 16), "offsets": []}]} if d else None for d in digests]
    want = dynamo_hash(tokens, bs, infos, cache_namespace=salt)
    vllm_ev = EventConverter(Flavour.VLLM, bs, None).convert({**base, "extra_keys": extra}, 0)
    assert list(vllm_ev[0].tokens_hashes) == want
    sglang_ev = EventConverter(Flavour.SGLANG, bs, None).convert({**base, "cache_salt": salt}, 0)
    assert list(sglang_ev[0].tokens_hashes) == dynamo_hash(tokens, bs, None, cache_namespace=salt)
