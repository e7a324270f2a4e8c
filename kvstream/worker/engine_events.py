"""Engine KV events → source events (DESIGN.md §3): the pure half of the engine bridge.

Reads one decoded vLLM or SGLang event (``vllm/distributed/kv_events.py``,
``sglang/srt/disaggregation/kv_events.py``, checked in tests/engines/ against their
publishers at the pinned versions, vLLM 0.33.0 and SGLang 0.5.23) and returns the
source events it means, with no sockets: the bridge
(:mod:`kvstream.worker.zmq_bridge`) brings the engines' messages and sequence numbers.

- events: msgspec tagged maps, ``{"type": "BlockStored", "block_hashes": ..., ...}``
  (older vLLM releases, and SGLang's positional form, encode them as arrays, tag first,
  in the engine's own field order: both are read, SGLang's with ``Flavour.SGLANG``);
  block hashes are ints, u64 or signed i64 (TensorRT-LLM's vLLM-format events: the
  same u64 either way), or bytes digests.

What the engines differ in (``Flavour``, given or detected from the event fields):
which tiers ``AllBlocksCleared`` clears (vLLM: its GPU prefix cache only, the CPU
offload cache survives; SGLang: device and host), and the identity fields (vLLM
``extra_keys`` and ``lookahead_token_ids``, SGLang ``cache_salt``), which enter the
blocks' local hashes as in Dynamo (kvstream.hashing).

An event that cannot be applied raises :class:`SkippedEvent` with its reason
(:class:`Issue`); the bridge counts and logs it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

import msgpack
import xxhash

from kvstream.events.errors import UnknownMediumError
from kvstream.events.model import Tier, tier_from_medium
from kvstream.hashing import local_hashes
from kvstream.logs import get_logger
from kvstream.worker.source_events import SourceCleared, SourceEvent, SourceRemoved, SourceStored

log = get_logger(__name__)

_U64 = (1 << 64) - 1
_TIER_ORDER = list(Tier)


class Issue(str, Enum):
    """Why engine input was skipped (or what went missing)."""

    MALFORMED_FRAME = "malformed_frame"  # not [topic, 8-byte seq, payload]
    MALFORMED_PAYLOAD = "malformed_payload"  # not msgpack of a batch
    MALFORMED_EVENT = "malformed_event"  # an event whose fields do not fit the format
    UNKNOWN_TAG = "unknown_tag"  # an event type this bridge does not know
    UNKNOWN_MEDIUM = "unknown_medium"  # medium that maps to no tier (DESIGN §2)
    LORA_WITHOUT_NAME = "lora_without_name"  # lora_id but no lora_name: hashes unknowable
    #: Blocks of another size than the router's: their hashes would never match a prompt.
    BLOCK_SIZE_MISMATCH = "block_size_mismatch"
    #: A partial last page (SGLang): only full blocks are ever matched (DESIGN §1).
    PARTIAL_BLOCK = "partial_block"
    #: A vLLM offload event without tokens (its default) naming a block that the device
    #: source does not hold: its tokens, hence its position, are unknown.
    UNRESOLVED_PLACEHOLDER = "unresolved_placeholder"
    #: Identity the router cannot express (prompt-embedding digests in extra_keys).
    UNSUPPORTED_IDENTITY = "unsupported_identity"
    GAP = "gap"  # engine messages missed (by sequence number), before any replay
    UNRECOVERED = "unrecovered"  # missed messages that the replay did not deliver
    DUPLICATE = "duplicate"  # a message already applied (live after a replay)
    ENGINE_RESTART = "engine_restart"  # sequence number went backwards
    #: Events of a KV-cache group other than group 0: hybrid models (e.g. sliding-window
    #: layers) report each group's blocks; the routers track the main group only.
    OTHER_KV_GROUP = "other_kv_group"


class Flavour(str, Enum):
    """Which engine speaks: decides what ``AllBlocksCleared`` clears."""

    AUTO = "auto"  # detected from the event fields; until then, a clear clears every tier
    VLLM = "vllm"
    SGLANG = "sglang"


#: Tiers each engine's reset really clears (DESIGN §2).
CLEARED_BY: Mapping[Flavour, frozenset[Tier]] = {
    Flavour.VLLM: frozenset({Tier.DEVICE}),
    Flavour.SGLANG: frozenset({Tier.DEVICE, Tier.HOST_PINNED}),
    Flavour.AUTO: frozenset(Tier),
}
#: Fields only vLLM's events carry (msgspec omits SGLang's optional fields when None,
#: while vLLM's medium and lora_name are required and always present).
_VLLM_ONLY = frozenset({"extra_keys", "group_idx", "kv_cache_spec_kind", "locality", "lookahead_token_ids", "ownership"})


class BlockResolver(Protocol):
    """What a source already knows of a block (the consolidator)."""

    def lookup(self, dp_rank: int, source: Tier, block_hash: int) -> tuple[int | None, int] | None: ...


def _u64(h: Any) -> int:
    """An engine block hash as u64: negative i64 reinterpreted; a bytes digest folded to
    64 bits by XXH3, stable per digest."""
    if isinstance(h, int) and not isinstance(h, bool):
        if -(1 << 63) <= h <= _U64:
            return h & _U64
        raise ValueError(f"block hash {h} outside the 64-bit range")
    if isinstance(h, bytes | bytearray):
        return xxhash.xxh3_64_intdigest(bytes(h))
    raise TypeError(f"block hash of type {type(h).__name__}")


def _u64_list(hashes: Any) -> tuple[int, ...]:
    if not isinstance(hashes, list | tuple):
        raise TypeError("block_hashes is not an array")
    try:
        # The common case, all ints: msgpack ints lie in [-2**63, 2**64), so masking
        # is exact. Anything else (bytes digests, junk) raises TypeError here.
        return tuple([h & _U64 for h in hashes])
    except TypeError:
        return tuple(_u64(h) for h in hashes)


def mm_hash_of(identifier: str) -> int | None:
    """A vLLM multimodal identifier as the u64 of Dynamo's block_mm_infos: Dynamo takes
    the canonical identifier (a 64-hex-digit digest) and reads its first 16 digits;
    anything else (a user-given uuid) it cannot express (None)."""
    if len(identifier) == 64 and all(c in _HEX for c in identifier):
        return int(identifier[:16], 16)
    return None


_HEX = frozenset("0123456789abcdefABCDEF")


def _release(refs: Counter[int], h: int) -> bool:
    """Take one extra announcement of ``h`` back; False when none is left (then the
    removal is the block's last)."""
    n = refs.get(h, 0)
    if n <= 0:
        return False
    if n == 1:
        del refs[h]
    else:
        refs[h] = n - 1
    return True


class SkippedEvent(Exception):
    """An engine event that is not applied; carries the reason."""

    def __init__(self, issue: Issue, detail: str, count: int = 1) -> None:
        super().__init__(detail)
        self.issue = issue
        self.count = count


#: vLLM's field order, for the array form of older releases (after the tag).
_VLLM_ARRAY_FIELDS = {
    "BlockStored": (
        "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
        "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window", "locality",
        "ownership", "session_id", "lookahead_token_ids",
    ),
    "BlockRemoved": ("block_hashes", "medium", "group_idx", "locality", "ownership"),
    "AllBlocksCleared": (),
}
#: SGLang's field order, for its positional form (msgspec ``array_like`` events, which
#: its PRs describe; 0.5.23 sends tagged maps): the salt comes before the LoRA name.
_SGLANG_ARRAY_FIELDS = {
    "BlockStored": (
        "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "cache_salt",
        "session_id", "lora_name",
    ),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}
#: Which order an engine's array events are read in (unknown: vLLM's, the older form).
_ARRAY_FIELDS = {
    Flavour.VLLM: _VLLM_ARRAY_FIELDS, Flavour.SGLANG: _SGLANG_ARRAY_FIELDS, Flavour.AUTO: _VLLM_ARRAY_FIELDS,
}


def _as_map(ev: Any, flavour: Flavour) -> tuple[Any, Mapping[str, Any]]:
    """(tag, fields) of a map- or array-encoded event."""
    if isinstance(ev, dict):
        return ev.get("type"), ev
    if isinstance(ev, list | tuple) and ev:
        names = _ARRAY_FIELDS[flavour].get(ev[0]) if isinstance(ev[0], str) else None
        return ev[0], dict(zip(names or (), ev[1:]))
    raise SkippedEvent(Issue.MALFORMED_EVENT, f"event is a {type(ev).__name__}, not a tagged map or array")


def _tier(ev: Mapping[str, Any]) -> Tier:
    medium = ev.get("medium")
    if medium is not None and not isinstance(medium, str):
        raise SkippedEvent(Issue.MALFORMED_EVENT, f"medium of type {type(medium).__name__}")
    try:
        tier = tier_from_medium(medium)
    except UnknownMediumError as exc:
        raise SkippedEvent(Issue.UNKNOWN_MEDIUM, str(exc)) from None
    # vLLM: a block held on behalf of the worker elsewhere (e.g. a shared pool).
    return Tier.EXTERNAL if ev.get("locality") == "REMOTE" else tier


def _check_group(tag: str, ev: Mapping[str, Any]) -> None:
    group = ev.get("group_idx")
    if group not in (None, 0):
        raise SkippedEvent(Issue.OTHER_KV_GROUP, f"{tag} of KV-cache group {group!r}")


@dataclass(slots=True)
class _Identity:
    """What besides tokens and LoRA names the blocks of one stored event."""

    salt: str | None = None
    mm: dict[int, list[int]] = field(default_factory=dict)
    extra_tokens: list[list[int] | None] | None = None


class EventConverter:
    """Engine events → source events, with the per-rank memory that needs: tiers seen
    (what a clear clears), cache salts of vLLM chains (vLLM names the salt in the first
    block's extra keys only; its children inherit it), the detected flavour."""

    def __init__(
        self, flavour: Flavour, block_size: int | None, resolver: BlockResolver | None, blocks_per_chunk: int = 1
    ) -> None:
        self.flavour = flavour
        self._block_size = block_size
        self._resolver = resolver
        self._per_chunk = blocks_per_chunk
        #: (rank, lower tier) → last block of an offloaded placeholder chunk → the
        #: chunk's blocks: vLLM's placeholder removal names the last block only.
        self.chunks: dict[tuple[int, Tier], dict[int, tuple[int, ...]]] = {}
        self.seen_tiers: dict[int, set[Tier]] = {}
        self.salts: dict[int, dict[int, str]] = {}
        #: Blocks of the last converted event that could not be resolved.
        self.unresolved = 0
        #: (rank, lower tier) → block hash → announcements beyond the first that are
        #: still live. vLLM's self-describing offload events announce a block shared by
        #: two chunks once per chunk, and its removal once per chunk evicted: the block
        #: stays until the last. (Device re-announcements are not paired with removals.)
        self.extra_refs: dict[tuple[int, Tier], Counter[int]] = {}

    # -- state (kept with the consolidator's by the bridge's state store) -------------

    def dump(self) -> bytes:
        return msgpack.packb(
            {
                "flavour": self.flavour.value,
                "tiers": {r: [t.value for t in ts] for r, ts in self.seen_tiers.items()},
                "salts": self.salts,
                "refs": [[r, t.value, dict(c)] for (r, t), c in self.extra_refs.items() if c],
                "chunks": [[r, t.value, c] for (r, t), c in self.chunks.items() if c],
            }
        )

    def load(self, data: bytes) -> None:
        d = msgpack.unpackb(data, strict_map_key=False)
        if self.flavour is Flavour.AUTO:
            self.flavour = Flavour(d["flavour"])
        self.seen_tiers = {r: {Tier(t) for t in ts} for r, ts in d["tiers"].items()}
        self.salts = {r: dict(m) for r, m in d["salts"].items()}
        self.extra_refs = {(r, Tier(t)): Counter(c) for r, t, c in d["refs"]}
        self.chunks = {(r, Tier(t)): {k: tuple(v) for k, v in c.items()} for r, t, c in d.get("chunks", ())}

    # -- conversion -------------------------------------------------------------------

    def convert(self, ev: Any, dp_rank: int) -> list[SourceEvent]:
        """One decoded engine event → source events. Raises :class:`SkippedEvent` for input
        that cannot be applied."""
        tag, fields = _as_map(ev, self.flavour)
        try:
            if self.flavour is Flavour.AUTO and isinstance(ev, dict):
                self._detect(fields)  # the array form is older vLLM's; nothing to learn
            if tag == "BlockStored":
                return self._stored(fields, dp_rank)
            if tag == "BlockRemoved":
                _check_group(tag, fields)
                tier = _tier(fields)
                hashes = _u64_list(fields.get("block_hashes"))
                self.seen_tiers.setdefault(dp_rank, set()).add(tier)
                salts = self.salts.get(dp_rank)
                if salts:
                    for h in hashes:
                        salts.pop(h, None)
                chunks = self.chunks.get((dp_rank, tier))
                if chunks:
                    hashes = tuple(b for h in hashes for b in chunks.pop(h, (h,)))
                refs = self.extra_refs.get((dp_rank, tier))
                if refs:
                    hashes = tuple(h for h in hashes if not _release(refs, h))
                return [SourceRemoved(tier, dp_rank, hashes)] if hashes else []
            if tag == "AllBlocksCleared":
                return self.cleared(dp_rank, CLEARED_BY[self.flavour])
        except (TypeError, ValueError, IndexError, KeyError, AttributeError) as exc:
            raise SkippedEvent(Issue.MALFORMED_EVENT, f"{tag}: {exc}") from None
        raise SkippedEvent(Issue.UNKNOWN_TAG, f"unknown event tag {tag!r}")

    def cleared(self, dp_rank: int, tiers: frozenset[Tier]) -> list[SourceEvent]:
        """``tiers`` of ``dp_rank`` dropped everything (those it ever reported)."""
        seen = self.seen_tiers.get(dp_rank, set())
        if Tier.DEVICE in tiers:
            self.salts.pop(dp_rank, None)
        for t in tiers:
            self.extra_refs.pop((dp_rank, t), None)
            self.chunks.pop((dp_rank, t), None)
        return [SourceCleared(t, dp_rank) for t in sorted(seen & tiers, key=_TIER_ORDER.index)]

    def _detect(self, ev: Mapping[str, Any]) -> None:
        if (
            "cache_salt" in ev
            or ev.get("medium") == "CPU_PINNED"
            # SGLang omits its optional fields when None (lora_name, a removal's
            # medium); vLLM's are required, hence always present.
            or ("lora_id" in ev and "lora_name" not in ev)
            or ("block_hashes" in ev and "token_ids" not in ev and "medium" not in ev)
        ):
            found = Flavour.SGLANG
        elif _VLLM_ONLY.intersection(ev) or ev.get("medium", 0) is None or ev.get("lora_name", 0) is None:
            found = Flavour.VLLM
        else:
            return
        self.flavour = found
        log.info("engine_flavour_detected", flavour=found.value)

    def _stored(self, ev: Mapping[str, Any], dp_rank: int) -> list[SourceEvent]:
        _check_group("BlockStored", ev)
        tier = _tier(ev)
        hashes = _u64_list(ev.get("block_hashes"))
        parent_raw = ev.get("parent_block_hash")
        parent = None if parent_raw is None else _u64(parent_raw)
        token_ids = ev.get("token_ids")
        block_size = ev.get("block_size")
        if not isinstance(token_ids, list | tuple):
            raise ValueError("token_ids is not an array")
        if type(block_size) is not int or block_size < 0:
            raise ValueError(f"block_size {block_size!r}")
        if hashes and (block_size == 0 or not token_ids) and tier is not Tier.DEVICE:
            return self._placeholder(tier, dp_rank, hashes)
        window: list[int] | None = None
        if token_ids and isinstance(token_ids[0], list | tuple):
            # SGLang's EAGLE pages: (token, next token) pairs. As Dynamo reads them: the
            # first of each pair, plus the last pair's second; a block's identity is its
            # tokens and the token after it (Dynamo's EAGLE window).
            if not all(isinstance(p, list | tuple) and len(p) == 2 for p in token_ids):
                raise ValueError("token_ids mixes pairs and tokens")
            window = [p[0] for p in token_ids] + [token_ids[-1][1]]
            token_ids = window[:-1]
        if block_size == 0 or not hashes or len(token_ids) != len(hashes) * block_size:
            raise ValueError(f"{len(hashes)} blocks of {block_size} tokens but {len(token_ids)} token ids")
        if self._block_size is not None and block_size != self._block_size:
            if len(hashes) == 1 and block_size < self._block_size:
                # SGLang publishes a node's last, partial page with its own size.
                raise SkippedEvent(Issue.PARTIAL_BLOCK, f"a partial block of {block_size} tokens")
            raise SkippedEvent(
                Issue.BLOCK_SIZE_MISMATCH,
                f"engine blocks of {block_size} tokens, routers use {self._block_size} "
                "(set the engine's block/page size to the routers' block_size)",
                len(hashes),
            )
        lora_name = ev.get("lora_name")
        if lora_name is not None and not isinstance(lora_name, str):
            raise ValueError(f"lora_name of type {type(lora_name).__name__}")
        if ev.get("lora_id") is not None and not lora_name:
            # Local hashes of adapter blocks are seeded by the adapter's name (DESIGN §1);
            # without it they would pose as base-model blocks and mislead routing.
            raise SkippedEvent(Issue.LORA_WITHOUT_NAME, f"lora_id {ev.get('lora_id')} without lora_name")
        ident = self._identity(ev, dp_rank, parent, len(hashes), lora_name)
        if window is not None:
            ident.extra_tokens = [[window[(i + 1) * block_size]] for i in range(len(hashes))]
        tokens_hashes = local_hashes(
            token_ids, block_size, lora_name, cache_salt=ident.salt, mm=ident.mm, extra_tokens=ident.extra_tokens
        )
        self.seen_tiers.setdefault(dp_rank, set()).add(tier)
        if ident.salt:
            self.salts.setdefault(dp_rank, {}).update(dict.fromkeys(hashes, ident.salt))
        out = SourceStored(tier, dp_rank, parent, hashes, tuple(tokens_hashes))
        self._count_repeats(out)
        return [out]

    def _count_repeats(self, ev: SourceStored) -> None:
        """Note the lower-tier blocks that the source already holds (see extra_refs)."""
        if ev.source is Tier.DEVICE or self._resolver is None:
            return
        lookup = self._resolver.lookup
        for h in ev.block_hashes:
            if lookup(ev.dp_rank, ev.source, h) is not None:
                self.extra_refs.setdefault((ev.dp_rank, ev.source), Counter())[h] += 1

    def _identity(
        self, ev: Mapping[str, Any], dp_rank: int, parent: int | None, n: int, lora_name: str | None
    ) -> _Identity:
        ident = _Identity(salt=ev.get("cache_salt"))  # SGLang: the request's salt
        extra = ev.get("extra_keys")
        if extra is not None:
            # vLLM: per block, in order: the LoRA name (when lora_name is set),
            # (mm identifier, offset) pairs, the cache salt, prompt-embedding digests.
            if len(extra) != n:
                raise ValueError(f"{len(extra)} extra_keys entries for {n} blocks")
            for i, keys in enumerate(extra):
                for key in keys or ():
                    if isinstance(key, list | tuple) and len(key) == 2 and isinstance(key[0], str):
                        # (identifier, offset): the identity is the object, wherever it starts.
                        mm = mm_hash_of(key[0])
                        if mm is None:
                            raise SkippedEvent(Issue.UNSUPPORTED_IDENTITY, f"multimodal identifier {key[0]!r} is not a digest")
                        ident.mm.setdefault(i, []).append(mm)
                    elif isinstance(key, str):
                        mm = mm_hash_of(key)  # older releases: a bare identifier
                        if mm is not None:
                            ident.mm.setdefault(i, []).append(mm)
                        elif i == 0 and key != lora_name and ident.salt is None:
                            # As Dynamo: the salt is the first block's plain string that
                            # is neither a multimodal digest nor the adapter's name.
                            ident.salt = key
                    else:  # prompt-embedding digests (bytes): no routing-side form
                        raise SkippedEvent(Issue.UNSUPPORTED_IDENTITY, f"extra key of type {type(key).__name__} in block {i}")
        if ident.salt is None and parent is not None:
            ident.salt = self.salts.get(dp_rank, {}).get(parent)
        if ident.salt is not None and not isinstance(ident.salt, str):
            raise ValueError(f"cache salt of type {type(ident.salt).__name__}")
        lookahead = ev.get("lookahead_token_ids")
        if lookahead is not None:
            if len(lookahead) != n:
                raise ValueError(f"{len(lookahead)} lookahead_token_ids entries for {n} blocks")
            ident.extra_tokens = list(lookahead)
        return ident

    def _placeholder(self, tier: Tier, dp_rank: int, hashes: tuple[int, ...]) -> list[SourceEvent]:
        """vLLM's default offload events name blocks by hash only; it uses the same hash
        for a GPU block and its copies, so what the device source knows fills them in.
        Each hash is a chunk's last block (``blocks_per_chunk`` of them: the chunk is
        that block and its parents on the device). Consecutive blocks that chain on the
        device form one stored event each run."""
        out: list[SourceEvent] = []
        run: list[int] = []
        run_tokens: list[int] = []
        run_parent: int | None = None
        missing = 0
        for h in hashes:
            chunk = self._chunk(dp_rank, h)
            if chunk is None:
                missing += self._per_chunk
                continue
            parent, blocks = chunk
            if run and parent != run[-1]:
                out.append(SourceStored(tier, dp_rank, run_parent, tuple(run), tuple(run_tokens)))
                run, run_tokens = [], []
            if not run:
                run_parent = parent
            for b, tokens in blocks:
                run.append(b)
                run_tokens.append(tokens)
            if len(blocks) > 1:
                self.chunks.setdefault((dp_rank, tier), {})[h] = tuple(b for b, _ in blocks)
        if run:
            out.append(SourceStored(tier, dp_rank, run_parent, tuple(run), tuple(run_tokens)))
        if out:
            self.seen_tiers.setdefault(dp_rank, set()).add(tier)
        for ev in out:
            self._count_repeats(ev)
        if missing:
            # Reported after the resolved part is applied; the caller counts it.
            self.unresolved = missing
        return out

    def _chunk(self, dp_rank: int, last: int) -> tuple[int | None, list[tuple[int, int]]] | None:
        """(the chunk's parent, its (block, tokens hash) pairs in order) of the chunk
        ending at device block ``last``; None when the device source cannot name all of
        it (a chunk starts at a multiple of its size: one that reaches a root early lost
        its parent on the device, and its place is unknown)."""
        if self._resolver is None:
            return None
        lookup = self._resolver.lookup
        blocks: list[tuple[int, int]] = []
        h: int | None = last
        parent: int | None = None
        while h is not None and len(blocks) < self._per_chunk:
            known = lookup(dp_rank, Tier.DEVICE, h)
            if known is None:
                return None
            parent, tokens = known
            blocks.append((h, tokens))
            h = parent
        if len(blocks) < self._per_chunk:
            return None
        blocks.reverse()
        return parent, blocks
