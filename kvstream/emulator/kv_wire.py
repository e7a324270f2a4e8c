"""vLLM 0.33's KV-event messages as msgspec structs: the same field names, order, tags and
options as ``vllm/distributed/kv_events.py``, so that the bytes are the ones vLLM writes
(msgspec sizes a struct's map header unlike a dict's: dicts would decode the same and
differ on the wire). Only the fields the emulator sets are given; the rest stay at
their defaults and are left out, as vLLM leaves them out."""

from __future__ import annotations

from typing import Any

import msgspec


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class _Event(msgspec.Struct, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    pass


class BlockStored(_Event):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(_Event):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(_Event):
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared
