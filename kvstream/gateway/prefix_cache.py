"""The prefix cache of prompt tokenization (kvstream.gateway.tokenize).

Conversations and agents resend the same system prompt and earlier turns; their ids
are cached per *segment*, a piece of text that ends right after an added token (``<|im_end|>``, ``<｜User｜>``...). HF ``tokenizers`` splits the text on
added tokens before anything else, so such a boundary is hard, provided that:

1. the token is matched on the raw text (``normalized=False``), does not swallow what
   follows (``rstrip=False``, ``single_word=False``) and does not end in whitespace (an
   ``lstrip`` token after it must not reach into it);
2. no added token could start inside the prefix and run past the boundary in some other
   continuation: no proper prefix of any added token is a suffix of the text before the
   boundary (checked on the actual text, for every boundary);
3. the tokenizer's own encoding put that very token there (its id at exactly those
   offsets; checked when a segment is cached).

Long texts without added tokens (a document, a long user message) are also cut between
words (:class:`WordCuts`): ``x y`` (ASCII letters around one space) splits the
pre-tokenization of the tokenizers whose pre-tokenizer is proven to split there (its
docstring), and the part after the cut is tokenized on its own.

A text that leaves a cached chain where an earlier one left it (the same document, another
question) shares their common part up to its last word cut (:meth:`PrefixCache.shared_after`,
:meth:`WordCuts.last_within`): that part becomes a segment of its own, so the next
question tokenizes only itself, not the document's last stride again (a text radix
tree's sharing, at the cuts that are proven hard).

The text after a cached boundary is tokenized behind the same added token (then dropped),
so that it is tokenized as a non-first piece, exactly as in the whole text. A segment is
keyed by its exact text and the node of the segment before it (a chain: the key holds
the whole prefix, compared as text, never by hash); each cache belongs to one tokenizer
instance. ``tests/gateway/test_tokenize.py`` proves ids with the cache equal ids without
on random conversations and texts (hypothesis). The cache is an LRU bounded in bytes; a
segment's ids are kept packed (native u32, 4 bytes each, as routing reads them), so a
prompt is its cached segments joined, never a list of Python ints built again.

Thread-safe: the cache is guarded by a lock held only for lookups and inserts, never
while tokenizing.
"""

from __future__ import annotations

import itertools
import re
import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import tokenizers


@dataclass(slots=True)
class _Segment:
    node: int
    #: Packed native u32.
    ids: bytes
    nbytes: int
    #: The text that last followed it (PrefixCache.shared_after), counted in the cache's
    #: bytes beside ``nbytes``.
    after: str = ""
    #: The lengths of the segments cut below it where texts diverged, latest first (a
    #: few: a document's end, a common first word of its questions).
    branches: list[int] = field(default_factory=list)


#: A segment's key: the node of the segment before it and its exact text (where a key may
#: be None, None is the root).
Key = tuple[int, str]


@dataclass(slots=True)
class CacheStats:
    lookups: int = 0
    #: Segments found, and their tokens (work saved).
    hit_segments: int = 0
    hit_tokens: int = 0
    inserted: int = 0
    evicted: int = 0
    #: A suffix whose sentinel did not tokenize back to the same token (never expected):
    #: the text was tokenized whole instead.
    fallbacks: int = 0


class Anchors:
    """The added tokens after which a text can be cut (module docstring, rules 1 and 2)."""

    def __init__(self, tok: tokenizers.Tokenizer) -> None:
        raw = [t for t in tok.get_added_tokens_decoder().values() if not t.normalized]
        self.ids: dict[str, int] = {}
        for tid, t in tok.get_added_tokens_decoder().items():
            if (not t.normalized and not t.rstrip and not t.single_word and t.content
                    and not t.content[-1].isspace()):
                self.ids[t.content] = tid
        #: Every proper prefix of a raw-matched added token, by length.
        self._prefixes: dict[int, set[str]] = {}
        for t in raw:
            for k in range(1, len(t.content)):
                self._prefixes.setdefault(k, set()).add(t.content[:k])
        # Where an anchor may start (a scan for a few characters is far faster than one
        # regex of every anchor), then the longest anchor there, as the tokenizer matches.
        self._lengths = sorted({len(c) for c in self.ids}, reverse=True)
        firsts = sorted({c[0] for c in self.ids})
        self._starts = re.compile("[" + "".join(map(re.escape, firsts)) + "]") if firsts else None

    def boundaries(self, text: str) -> list[tuple[int, str]]:
        """(end offset, token) of each anchor occurrence in ``text`` (leftmost, longest,
        not overlapping) that no added token could run across."""
        if self._starts is None:
            return []
        out = []
        ids, lengths, prefixes = self.ids, self._lengths, self._prefixes
        after = 0
        for m in self._starts.finditer(text):
            pos = m.start()
            if pos < after:
                continue
            for n in lengths:
                if text[pos:pos + n] in ids:
                    end = after = pos + n
                    if not any(text[end - k:end] in ps for k, ps in prefixes.items() if k <= end):
                        out.append((end, text[pos:end]))
                    break
        return out


#: The pre-tokenizers under which ``x y`` is a hard split, as ``tokenizer.json`` writes
#: them (the ``Split`` regexes of a ``Sequence``, ending in ``ByteLevel`` without its
#: own regex), by the models that use them.
WORD_SPLIT_PATTERNS: dict[tuple[str, ...], str] = {
    (r"\p{N}{1,3}", "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
     "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+|"
     " ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"): "DeepSeek-V3",
    ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
     "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",): "Llama 3 (cl100k)",
    ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
     "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",): "Qwen2",
}
#: A word cut is the first ``x y`` at or after each multiple of this many characters.
WORD_CUT_STRIDE = 2048


class WordCuts:
    """Cuts between words of long texts, for the tokenizers where they are provably hard.

    The cut goes at the space of ``x y`` (ASCII letters ``x`` and ``y``). Under each
    pre-tokenizer of ``WORD_SPLIT_PATTERNS`` (and GPT-2's ``ByteLevel`` with its own
    regex), without a normalizer, every regex alternative that matches a letter matches
    a run of letters (marks) and no whitespace after it, and none can start inside such
    a run and reach past its end; the run's end is found by a greedy class that stops at
    the space, as it stops at the end of a text: the pieces of the text before the cut
    are those of the whole text up to the cut. The piece after starts at the space (an
    optional non-letter, then letters) and none of the patterns looks behind or anchors:
    the pieces of the rest are those of the whole text from the cut. BPE works within a
    piece, and ``ByteLevel`` with ``add_prefix_space`` off treats a first piece as any
    other, so the ids of the text are the ids of the two parts. Added tokens are split
    first: none may hold whitespace or strip it (lstrip, rstrip, single_word), so none
    spans the space. ``tests/gateway/test_tokenize.py`` checks the rule on the DeepSeek
    tokenizer and on tokenizers built with each pattern (hypothesis)."""

    _CUT = re.compile("[A-Za-z] [A-Za-z]")
    _SPACE = re.compile("(?<=[A-Za-z]) (?=[A-Za-z])")

    def __init__(self, stride: int = WORD_CUT_STRIDE) -> None:
        self.stride = stride

    @classmethod
    def proven_for(cls, tok: tokenizers.Tokenizer, stride: int = WORD_CUT_STRIDE) -> WordCuts | None:
        """WordCuts when ``tok`` is one the rule is proven for, else None."""
        import json

        from tokenizers.models import BPE

        # Each part's own JSON (the whole tokenizer's would write out its vocabulary).
        normalizer = json.loads(tok.normalizer.__getstate__()) if tok.normalizer is not None else None
        pre = json.loads(tok.pre_tokenizer.__getstate__()) if tok.pre_tokenizer is not None else {}
        if normalizer and not (normalizer.get("type") == "Sequence" and not normalizer.get("normalizers")):
            return None
        if not isinstance(tok.model, BPE) or tok.model.dropout:
            return None
        for t in tok.get_added_tokens_decoder().values():
            if t.lstrip or t.rstrip or t.single_word or any(c.isspace() for c in t.content):
                return None
        if pre.get("type") == "ByteLevel":  # GPT-2's regex, built in
            proven = pre.get("use_regex", True) and not pre.get("add_prefix_space")
        elif pre.get("type") == "Sequence":
            steps = pre.get("pretokenizers") or []
            last = steps[-1] if steps else {}
            splits = steps[:-1]
            proven = (
                last.get("type") == "ByteLevel" and not last.get("use_regex") and not last.get("add_prefix_space")
                and all(s.get("type") == "Split" and s.get("behavior") == "Isolated" and not s.get("invert")
                        and "Regex" in (s.get("pattern") or {}) for s in splits)
                and tuple(s["pattern"]["Regex"] for s in splits) in WORD_SPLIT_PATTERNS
            )
        else:
            proven = False
        return cls(stride) if proven else None

    def boundaries(self, text: str) -> list[tuple[int, str]]:
        """(offset of the space, "") of the first ``x y`` at or after each multiple of the
        stride (the cuts of a text's prefix are the same in every text that extends it)."""
        out: list[tuple[int, str]] = []
        pos = self.stride - 1
        search = self._CUT.search
        while pos < len(text) - 2 and (m := search(text, pos)) is not None:
            cut = m.start() + 1
            out.append((cut, ""))
            pos = max(cut, (cut // self.stride + 1) * self.stride - 1)
        return out

    def is_cut(self, text: str, p: int) -> bool:
        """Whether ``p`` is the space of an ``x y`` of ``text``."""
        return self._CUT.match(text, p - 1, p + 2) is not None if p >= 1 else False

    def last_within(self, text: str, lo: int, hi: int) -> int | None:
        """The last cut ``p`` (the space of an ``x y`` of ``text``) with lo < p <= hi."""
        last = None
        for m in self._SPACE.finditer(text, lo + 1, min(hi + 2, len(text))):
            last = m.start()
        return last


def _common(a: str, b: str) -> int:
    """The length of the common prefix of ``a`` and ``b`` (slices compared in C)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


#: Branch segments remembered per node (PrefixCache.branches).
MAX_BRANCHES = 4


class PrefixCache:
    """Segment chains → ids, LRU-bounded in bytes (module docstring)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self.stats = CacheStats()
        self._entries: OrderedDict[Key, _Segment] = OrderedDict()
        #: Node 0, before every chain's first segment (never evicted).
        self._root = _Segment(0, b"", 0)
        self._lock = threading.Lock()
        # Node ids are never reused: a segment under an evicted parent is unreachable,
        # never attached to another prefix.
        self._next = itertools.count(1)

    def __len__(self) -> int:
        return len(self._entries)

    def longest(self, text: str, cuts: list[tuple[int, str]], node: int = 0, start: int = 0,
                above: list[Key] | None = None) -> tuple[int, int, list[bytes], list[Key]]:
        """(cuts matched, node of the last, their packed ids, their keys) for the longest
        cached prefix, from ``node`` at offset ``start`` (the root: the text's start;
        else ``above`` are the keys of the chain down to ``node``)."""
        ids: list[bytes] = []
        keys: list[Key] = []
        with self._lock:
            self.stats.lookups += 1
            for end, _ in cuts:
                key = (node, text[start:end])
                seg = self._entries.get(key)
                if seg is None:
                    break
                keys.append(key)
                ids.append(seg.ids)
                node, start = seg.node, end
            self._touch((above or []) + keys)
            self.stats.hit_segments += len(keys)
            self.stats.hit_tokens += sum(map(len, ids)) // 4
        return len(keys), node, ids, keys

    def shared_after(self, at: Key | None, text: str, start: int, keep: int) -> int:
        """How many characters of ``text`` from ``start`` the text that last followed the
        segment ``at`` had in common with it; ``text[start:start + keep]`` follows it now."""
        tail = text[start:start + keep]
        with self._lock:
            old = self._remember(at, tail)
            self._evict()
        return _common(old, tail) if old else 0

    def _held(self, at: Key | None) -> _Segment | None:
        return self._root if at is None else self._entries.get(at)

    def _remember(self, at: Key | None, tail: str) -> str:
        """``tail`` follows the segment ``at`` now; what followed it before ("" if
        nothing, or if the segment was evicted meanwhile)."""
        seg = self._held(at)
        if seg is None:
            return ""
        old, seg.after = seg.after, tail
        self.bytes += sys.getsizeof(tail) - (sys.getsizeof(old) if old else 0)
        return old

    def branches(self, at: Key | None) -> list[int]:
        """The lengths of the segments cut below the segment ``at`` where texts diverged."""
        with self._lock:
            seg = self._held(at)
            return list(seg.branches) if seg is not None else []

    def add_branch(self, at: Key | None, length: int) -> None:
        with self._lock:
            seg = self._held(at)
            if seg is not None and length not in seg.branches:
                seg.branches.insert(0, length)
                del seg.branches[MAX_BRANCHES:]

    def segment(self, key: Key) -> _Segment | None:
        """The segment under ``key``, or None (a longest() from it touches the chain)."""
        with self._lock:
            seg = self._entries.get(key)
            if seg is not None:
                self.stats.hit_segments += 1
                self.stats.hit_tokens += len(seg.ids) // 4
            return seg

    def _touch(self, chain: list[Key]) -> None:
        # A prefix's segments become the most recent, the first one last of all: the LRU
        # then evicts the ends of chains before their beginnings, never orphaning the rest.
        for key in reversed(chain):
            if key in self._entries:
                self._entries.move_to_end(key)

    def fallback(self) -> None:
        with self._lock:
            self.stats.fallbacks += 1

    def insert(self, parent: int, pieces: list[tuple[str, bytes]], above: list[Key],
               last_on: str = "") -> None:
        """Add a chain of (segment text, packed ids) under ``parent``, the end of the chain
        ``above`` (the keys of the segments before it); ``last_on``: the text from the
        last piece on, which a next text that leaves the chain before that piece (its
        end is where texts diverge) shares with it (shared_after)."""
        chain: list[Key] = []
        with self._lock:
            for n, (text, ids) in enumerate(pieces):
                key = (parent, text)
                seg = self._entries.get(key)
                if seg is None:
                    # The text, the packed ids, and the key, entry and node around them.
                    nbytes = sys.getsizeof(text) + sys.getsizeof(ids) + 200
                    if nbytes > self.max_bytes:
                        break
                    seg = _Segment(next(self._next), ids, nbytes)
                    self._entries[key] = seg
                    self.bytes += nbytes
                    self.stats.inserted += 1
                if n == len(pieces) - 1 and last_on:
                    self._remember(chain[-1] if chain else above[-1] if above else None, last_on)
                chain.append(key)
                parent = seg.node
            self._touch(above + chain)
            self._evict()

    def _evict(self) -> None:
        while self.bytes > self.max_bytes:
            if not self._entries:  # the root's remembered text alone is over the budget
                self._remember(None, "")
                break
            _, old = self._entries.popitem(last=False)
            self.bytes -= old.nbytes + (sys.getsizeof(old.after) if old.after else 0)
            self.stats.evicted += 1
