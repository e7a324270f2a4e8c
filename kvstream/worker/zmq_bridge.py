"""ZMQ engine bridge (DESIGN.md §3): stock vLLM or SGLang KV-event streams in, source
events out (to the consolidator).

The wire format is the engines' own (``vllm/distributed/kv_events.py``,
``sglang/srt/disaggregation/kv_events.py``), checked in tests/engines/ against their
publishers at the pinned versions (vLLM 0.33.0, SGLang 0.5.23):

- live: a ZMQ PUB multipart ``[topic, seq, payload]``, ``seq`` an 8-byte big-endian
  counter per publisher (one publisher per DP rank, each on its own port), ``payload``
  msgpack of ``[ts, events, dp_rank]``;
- events: msgspec tagged maps, ``{"type": "BlockStored", "block_hashes": ..., ...}``
  (older vLLM releases, and SGLang's positional form, encode them as arrays, tag first,
  in the engine's own field order: both are read, SGLang's with ``Flavour.SGLANG``);
  block hashes are ints, u64 or signed i64 (TensorRT-LLM's vLLM-format events: the
  same u64 either way), or bytes digests;
- replay: a ROUTER that takes ``[b"", start_seq]`` from a DEALER and answers
  ``[b"", topic, seq, payload]`` per buffered message from ``start_seq`` on, then
  ``[b"", b"", -1, b""]`` (releases before the topic frame: the same without it).

What the engines differ in (``Flavour``, given or detected from the event fields):
which tiers ``AllBlocksCleared`` clears (vLLM: its GPU prefix cache only, the CPU
offload cache survives; SGLang: device and host), and the identity fields (vLLM
``extra_keys`` and ``lookahead_token_ids``, SGLang ``cache_salt``), which enter the
blocks' local hashes as in Dynamo (kvstream.hashing).

Bad input is counted by reason (:class:`Issue`), logged (the first of each kind as a
warning), and skipped; it is never fatal.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

import msgpack
import xxhash
import zmq
from zmq.utils.monitor import recv_monitor_message

from kvstream.events.errors import UnknownMediumError
from kvstream.events.model import Tier, tier_from_medium
from kvstream.hashing import DEFAULT_BLOCK_SIZE, local_hashes
from kvstream.logs import get_logger
from kvstream.worker.errors import EngineBridgeError
from kvstream.worker.options import DEFAULTS
from kvstream.worker.source_events import (
    SourceCleared,
    SourceEvent,
    SourceEventSink,
    SourceRemoved,
    SourceStored,
)

log = get_logger(__name__)

_U64 = (1 << 64) - 1
_END_SEQ = _U64  # -1 as signed 8 bytes, read unsigned
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


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One engine publisher: one DP rank's PUB socket and its replay socket."""

    #: The PUB endpoint, e.g. ``tcp://127.0.0.1:5557``.
    endpoint: str
    #: The replay (ROUTER) endpoint; None: gaps are counted, not repaired.
    replay_endpoint: str | None = None
    #: Rank of batches that carry none.
    default_dp_rank: int = 0


@dataclass(frozen=True, slots=True)
class BridgeOptions:
    endpoints: tuple[Endpoint, ...]
    #: Subscription prefix (the engines' ``topic``, empty by default).
    topic: bytes = b""
    flavour: Flavour = Flavour.AUTO
    #: The routers' block size; events of another size are skipped (None: no check).
    block_size: int | None = DEFAULT_BLOCK_SIZE
    #: How long to wait for a replay to finish.
    replay_timeout_ms: int = 2000
    #: Receive high-water mark, in messages.
    rcvhwm: int = 1_000_000
    #: vLLM's offloading connector ``blocks_per_chunk``: one offload placeholder event
    #: (no tokens) names a chunk by its last block only. Not on the wire.
    offload_blocks_per_chunk: int = DEFAULTS.offload_blocks_per_chunk

    def __post_init__(self) -> None:
        if self.offload_blocks_per_chunk < 1:
            raise ValueError(f"offload_blocks_per_chunk must be >= 1, got {self.offload_blocks_per_chunk}")
        if not self.endpoints:
            raise ValueError("a bridge needs at least one engine endpoint")
        names = [e.endpoint for e in self.endpoints]
        if len(set(names)) != len(names):
            raise ValueError(f"engine endpoints repeat: {names}")


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


class _Skip(Exception):
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
    raise _Skip(Issue.MALFORMED_EVENT, f"event is a {type(ev).__name__}, not a tagged map or array")


def _tier(ev: Mapping[str, Any]) -> Tier:
    medium = ev.get("medium")
    if medium is not None and not isinstance(medium, str):
        raise _Skip(Issue.MALFORMED_EVENT, f"medium of type {type(medium).__name__}")
    try:
        tier = tier_from_medium(medium)
    except UnknownMediumError as exc:
        raise _Skip(Issue.UNKNOWN_MEDIUM, str(exc)) from None
    # vLLM: a block held on behalf of the worker elsewhere (e.g. a shared pool).
    return Tier.EXTERNAL if ev.get("locality") == "REMOTE" else tier


def _check_group(tag: str, ev: Mapping[str, Any]) -> None:
    group = ev.get("group_idx")
    if group not in (None, 0):
        raise _Skip(Issue.OTHER_KV_GROUP, f"{tag} of KV-cache group {group!r}")


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
        """One decoded engine event → source events. Raises :class:`_Skip` for input
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
            raise _Skip(Issue.MALFORMED_EVENT, f"{tag}: {exc}") from None
        raise _Skip(Issue.UNKNOWN_TAG, f"unknown event tag {tag!r}")

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
                raise _Skip(Issue.PARTIAL_BLOCK, f"a partial block of {block_size} tokens")
            raise _Skip(
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
            raise _Skip(Issue.LORA_WITHOUT_NAME, f"lora_id {ev.get('lora_id')} without lora_name")
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
                            raise _Skip(Issue.UNSUPPORTED_IDENTITY, f"multimodal identifier {key[0]!r} is not a digest")
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
                        raise _Skip(Issue.UNSUPPORTED_IDENTITY, f"extra key of type {type(key).__name__} in block {i}")
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


@dataclass(slots=True)
class BridgeStats:
    messages: int = 0  # engine messages handled (live and replayed)
    events: int = 0  # engine events turned into source events
    replayed: int = 0  # messages recovered through the replay endpoints


#: Applied messages remembered per endpoint to tell a duplicate (live after a replay)
#: from a restarted engine's message of the same number: more than a replay can
#: overlap the live stream by (what arrives while the buffer is read).
_RECENT = 4096


@dataclass(slots=True)
class _Stream:
    """One endpoint's sockets and sequence bookkeeping."""

    ep: Endpoint
    sub: zmq.Socket | None = None
    monitor: zmq.Socket | None = None
    handshakes: int = 0
    #: Next engine sequence number expected (None: nothing seen yet).
    expected: int | None = None
    #: XXH3 of the last payload applied: a restarted engine's message of that number
    #: differs, which is how a reconnection tells a new engine from the same one.
    last_digest: int = 0
    #: (number, XXH3) of the last ``_RECENT`` messages applied, at number % _RECENT: a
    #: number seen again is a duplicate only with the same bytes.
    recent: list[tuple[int, int] | None] = field(default_factory=lambda: [None] * _RECENT)
    ranks: set[int] = field(default_factory=set)


class ZmqEngineBridge:
    """Subscribes to one or more engine publishers (one per DP rank) and feeds ``sink``.
    Single-threaded: call :meth:`poll` from the worker loop.

    Engine sequence numbers start at 0 in every engine process and carry no process
    identity. So on every (re)connection to an endpoint, the bridge asks the engine's
    replay buffer for the last message it applied: the same bytes mean the same engine
    (and the rest of the reply is what it missed); anything else means a restarted
    engine (its caches are empty: every tier of its ranks is cleared, and its buffer is
    replayed from 0). Knowing no position (a new worker, or one that lost its state),
    it asks for the buffer from 0: an idle engine's blocks are known at once. Without a
    reconnection (a forwarder between engine and bridge), a restart shows in the
    numbers and bytes: a number seen again with other bytes, or a jump whose replay
    starts with other bytes than the last message applied."""

    def __init__(
        self,
        options: BridgeOptions,
        sink: SourceEventSink,
        resolver: BlockResolver | None = None,
        context: zmq.Context | None = None,
    ) -> None:
        self.options = options
        self._sink = sink
        self._ctx = context or zmq.Context.instance()
        self._streams = [_Stream(ep) for ep in options.endpoints]
        self._by_socket: dict[zmq.Socket, _Stream] = {}
        self._monitors: dict[zmq.Socket, _Stream] = {}
        self._poller = zmq.Poller()
        self.converter = EventConverter(
            options.flavour, options.block_size, resolver, options.offload_blocks_per_chunk
        )
        self.stats = BridgeStats()
        #: Skipped / missing input by reason.
        self.issues: Counter[Issue] = Counter()
        #: Set when engine history was lost for good (the worker then resyncs).
        self.resync_reason: str | None = None

    # ------------------------------------------------------------------ state

    def positions(self) -> dict[str, tuple[int, int, list[int]]]:
        """Per endpoint seen: (next engine sequence number, digest of the last payload,
        the ranks it published)."""
        return {
            s.ep.endpoint: (s.expected, s.last_digest, sorted(s.ranks)) for s in self._streams if s.expected is not None
        }

    def restore(self, positions: Mapping[str, Sequence[Any]], converter_state: bytes | None) -> None:
        """Continue from a saved state: :meth:`connect` then checks that each engine is
        the same and replays its buffer from there."""
        for s in self._streams:
            if s.ep.endpoint in positions:
                expected, digest, ranks = positions[s.ep.endpoint]
                s.expected, s.last_digest, s.ranks = expected, digest, set(ranks)
        if converter_state is not None:
            self.converter.load(converter_state)

    # ------------------------------------------------------------------ sockets

    def connect(self) -> None:
        for s in self._streams:
            sub = self._ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.RCVHWM, self.options.rcvhwm)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.SUBSCRIBE, self.options.topic)
            try:
                s.monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
                sub.connect(s.ep.endpoint)
            except zmq.ZMQError as exc:
                sub.close(linger=0)
                self.close()
                raise EngineBridgeError(f"cannot connect to engine endpoint {s.ep.endpoint!r}: {exc}") from None
            s.sub = sub
            self._by_socket[sub] = s
            self._monitors[s.monitor] = s
            self._poller.register(sub, zmq.POLLIN)
            self._poller.register(s.monitor, zmq.POLLIN)
        for s in self._streams:
            self._resume(s)

    def close(self) -> None:
        for s in self._streams:
            if s.sub is not None:
                self._poller.unregister(s.sub)
                if s.monitor is not None:
                    self._poller.unregister(s.monitor)
                    s.sub.disable_monitor()
                    s.monitor.close(linger=0)
                    s.monitor = None
                s.sub.close(linger=0)
                s.sub = None
        self._by_socket.clear()
        self._monitors.clear()

    def poll(self, timeout_ms: int, max_messages: int = 1024) -> int:
        """Handle what arrives within ``timeout_ms`` (at most ``max_messages`` per
        endpoint, without waiting once one is there); returns how many were handled."""
        if not self._by_socket:
            raise EngineBridgeError("bridge is not connected (call connect())")
        n = 0
        for sock, _ in self._poller.poll(timeout_ms):
            stream = self._by_socket.get(sock)
            if stream is None:
                self._check_connection(self._monitors[sock])
                continue
            for _ in range(max_messages):
                # A reconnection is dealt with before any message that came through it.
                self._check_connection(stream)
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self.handle_frames(frames, stream)
                n += 1
        return n

    def _check_connection(self, s: _Stream) -> None:
        mon = s.monitor
        while mon is not None and mon.poll(0):
            event = recv_monitor_message(mon)
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                s.handshakes += 1
                if s.handshakes > 1:  # the first one is connect()'s, already resumed
                    self._resume(s)

    # ------------------------------------------------------------------ input

    def handle_frames(self, frames: Sequence[bytes], stream: _Stream | None = None) -> None:
        """One engine message: ``[topic, seq, payload]`` (of the first endpoint unless
        ``stream`` says)."""
        s = stream or self._streams[0]
        if len(frames) != 3 or len(frames[1]) != 8:
            shape = [len(f) for f in frames]
            self._issue(Issue.MALFORMED_FRAME, f"frame sizes {shape}, expected [topic, 8-byte seq, payload]")
            return
        seq = int.from_bytes(frames[1], "big")
        payload = frames[2]
        digest = xxhash.xxh3_64_intdigest(payload)
        if s.expected is not None and seq < s.expected:
            if s.recent[seq % _RECENT] == (seq, digest):
                # Already applied (it came through a replay too).
                self._issue(Issue.DUPLICATE, f"message {seq} already applied")
                return
            # A number seen before with other bytes (or too old to be a duplicate): a
            # new engine numbering from 0 again, seen without a reconnection (a ZMQ
            # forwarder or proxy keeps ours up across the engine's restart).
            self._restart(s)
        if seq > (s.expected or 0):
            # Engines number their messages from 0: a worker joining a running engine
            # (or one that missed messages) gets the rest from the replay buffer.
            self._gap(s, seq)
        self._apply(s, seq, payload, digest)

    def _apply(self, s: _Stream, seq: int, payload: bytes, digest: int | None = None) -> None:
        s.expected = seq + 1
        s.last_digest = xxhash.xxh3_64_intdigest(payload) if digest is None else digest
        s.recent[seq % _RECENT] = (seq, s.last_digest)
        self.handle_payload(payload, s)

    def handle_payload(self, payload: bytes, stream: _Stream | None = None) -> None:
        """One msgpack ``EventBatch`` ``[ts, events, dp_rank]`` (or its map form)."""
        s = stream or self._streams[0]
        try:
            batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        except (ValueError, TypeError, msgpack.UnpackException) as exc:
            self._issue(Issue.MALFORMED_PAYLOAD, f"not msgpack: {type(exc).__name__} {exc}")
            return
        if isinstance(batch, list) and len(batch) >= 2:
            events, rank = batch[1], batch[2] if len(batch) > 2 else None
        elif isinstance(batch, dict):
            events, rank = batch.get("events"), batch.get("data_parallel_rank")
        else:
            self._issue(Issue.MALFORMED_PAYLOAD, f"batch is a {type(batch).__name__}")
            return
        if rank is None:
            rank = s.ep.default_dp_rank
        if not isinstance(events, list) or type(rank) is not int or rank < 0:
            self._issue(Issue.MALFORMED_PAYLOAD, "batch needs an events array and a rank >= 0")
            return
        self.stats.messages += 1
        s.ranks.add(rank)
        sink = self._sink
        conv = self.converter
        for ev in events:
            conv.unresolved = 0
            try:
                converted = conv.convert(ev, rank)
            except _Skip as skip:
                self._issue(skip.issue, str(skip), skip.count)
                continue
            self.stats.events += 1
            for source_event in converted:
                sink.on_source_event(source_event)
            if conv.unresolved:
                self._issue(
                    Issue.UNRESOLVED_PLACEHOLDER,
                    f"rank {rank}: {conv.unresolved} offloaded blocks unknown to the device source "
                    "(enable vLLM's self-describing KV events)",
                    conv.unresolved,
                )

    def _issue(self, issue: Issue, detail: str, count: int = 1) -> None:
        first = issue not in self.issues
        self.issues[issue] += count
        (log.warning if first else log.debug)("engine_input_issue", issue=issue.value, detail=detail)

    # ------------------------------------------------------------------ gaps

    def _gap(self, s: _Stream, seq: int) -> None:
        """Live message ``seq`` came after a hole: from the next expected one (from 0
        when nothing was seen). With a replay endpoint the buffer fills it, from the
        last message applied, whose bytes tell the same engine from a restarted one
        that published more than we had seen."""
        start = s.expected or 0
        got = 0
        if s.ep.replay_endpoint:
            msgs = self._fetch(s, start - 1 if start else 0)
            if msgs and start and msgs[0][0] == start - 1:
                if xxhash.xxh3_64_intdigest(msgs[0][1]) != s.last_digest:
                    self._restart(s)
                    start = 0
                    msgs = self._fetch(s, 0)
                else:
                    msgs = msgs[1:]
            self._issue(Issue.GAP, f"{s.ep.endpoint}: engine messages {start}..{seq - 1} missed", seq - start)
            for rseq, payload in msgs or ():
                if rseq >= seq:
                    break
                # Only the missing range, in order: a hole in the buffer stays a hole.
                if rseq >= (s.expected or 0):
                    self._apply(s, rseq, payload)
                    got += 1
            self.stats.replayed += got
        else:
            self._issue(Issue.GAP, f"{s.ep.endpoint}: engine messages {start}..{seq - 1} missed", seq - start)
        if got < seq - start:
            self._lost(s, seq - start - got)

    def _lost(self, s: _Stream, count: int) -> None:
        self._issue(Issue.UNRECOVERED, f"{s.ep.endpoint}: {count} engine messages lost (not in the replay buffer)", count)
        self.resync_reason = f"{count} engine messages of {s.ep.endpoint} lost"

    def _resume(self, s: _Stream) -> None:
        """On every (re)connection: an engine we never heard from gives its buffer from
        the start (it may hold blocks and publish nothing for a long time); one we
        heard from is the same engine if its buffer holds our last message byte for
        byte (the rest is what we missed), else a new one (a restart)."""
        if not s.ep.replay_endpoint:
            return
        if s.expected is None:
            self._join(s)
            return
        last = s.expected - 1
        msgs = self._fetch(s, last)
        if msgs is None:
            return  # no answer: the live numbers and bytes will tell
        if msgs and msgs[0][0] == last and xxhash.xxh3_64_intdigest(msgs[0][1]) == s.last_digest:
            got = 0
            for rseq, payload in msgs[1:]:
                if rseq == s.expected:
                    self._apply(s, rseq, payload)
                    got += 1
            self.stats.replayed += got
            return
        if msgs and msgs[0][0] > last:
            # Our last message fell out of the buffer: what came between is lost (or
            # this is a new engine that published more than we had seen: the numbers
            # cannot tell, and the state is kept).
            if msgs[0][0] > s.expected:
                self._lost(s, msgs[0][0] - s.expected)
            for rseq, payload in msgs:
                self._apply(s, rseq, payload)
            self.stats.replayed += len(msgs)
            return
        self._restart(s)
        self._join(s)

    def _join(self, s: _Stream) -> None:
        """No position known (a new worker, or one that lost its state): the engine's
        history is its buffer from message 0; what fell out of it is counted lost."""
        msgs = self._fetch(s, 0)
        if not msgs:
            return  # nothing published yet, or no answer: the live numbers will tell
        first = msgs[0][0]
        if first > (s.expected or 0):
            self._lost(s, first - (s.expected or 0))
        for rseq, payload in msgs:
            if rseq >= (s.expected or 0):
                self._apply(s, rseq, payload)
        self.stats.replayed += len(msgs)

    def _fetch(self, s: _Stream, start: int) -> list[tuple[int, bytes]] | None:
        """The endpoint's buffered messages from ``start`` on, in order; None when the
        replay socket did not finish answering in time."""
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        out: list[tuple[int, bytes]] = []
        topic = self.options.topic
        try:
            dealer.connect(s.ep.replay_endpoint)  # type: ignore[arg-type]
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while dealer.poll(self.options.replay_timeout_ms, zmq.POLLIN):
                frames = dealer.recv_multipart()
                # [b"", topic, seq, payload] (current engines) or [b"", seq, payload].
                if len(frames) == 4 and len(frames[2]) == 8:
                    msg_topic, seq_bytes, payload = frames[1], frames[2], frames[3]
                elif len(frames) == 3 and len(frames[1]) == 8:
                    msg_topic, seq_bytes, payload = None, frames[1], frames[2]
                else:
                    self._issue(Issue.MALFORMED_FRAME, f"replay reply of {len(frames)} frames")
                    continue
                seq = int.from_bytes(seq_bytes, "big")
                if seq == _END_SEQ:
                    return out
                if msg_topic is None or msg_topic.startswith(topic):
                    out.append((seq, payload))
            log.warning("engine_replay_timeout", endpoint=s.ep.replay_endpoint, start=start)
            return None
        finally:
            dealer.close(linger=0)

    def _restart(self, s: _Stream) -> None:
        """A new engine process on this endpoint: its caches start empty (every tier:
        its host and disk caches died with it)."""
        self._issue(Issue.ENGINE_RESTART, f"{s.ep.endpoint}: a new engine process (after message {(s.expected or 0) - 1})")
        for rank in sorted(s.ranks):
            for ev in self.converter.cleared(rank, frozenset(Tier)):
                self._sink.on_source_event(ev)
        s.expected = 0
        s.recent = [None] * _RECENT
