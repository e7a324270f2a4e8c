"""Token ids of a request's prompt inside the request path (issue 22, item 3): the
:class:`~kvstream.gateway.seams.PromptTokenizer` implementations.

- :class:`LocalTokenizer`: a model's ``tokenizer.json`` (HF ``tokenizers``) and its chat
  template (``tokenizer_config.json``'s ``chat_template``, a string or a list of named
  templates; or ``chat_template.jinja``; or a file given in the settings), rendered in a
  sandboxed jinja2 environment set up as ``transformers``' ``apply_chat_template`` sets
  it up (trim_blocks, lstrip_blocks, loop controls, ``raise_exception``, a ``tojson``
  that does not escape HTML, ``strftime_now``, the ``generation`` tag), then tokenized
  without adding special tokens again, as vLLM does for chat. Completion text gets the
  special tokens the engine adds (``add_special_tokens=True``): those of the
  ``tokenizer.json`` post-processor (transformers ignores ``add_bos_token`` /
  ``add_eos_token`` of ``tokenizer_config.json`` when there is a ``tokenizer.json``).

Asking the chosen engine's ``/tokenize`` instead is the relay's (``[gateway] tokenize =
"engine"``, kvstream.gateway.prompts).

The ids of shared prefixes (system prompts, earlier turns, long documents) are cached at
boundaries where the tokenizer provably splits (kvstream.gateway.prefix_cache), so that
cached ids always equal fresh ones; what is not cached is tokenized in the pieces those
boundaries cut, in one batch that ``tokenizers`` spreads over the cores. Ids come out as
a uint32 array, the cached segments' packed ids joined (a 20k-token prompt is one copy of
80 KB, never 20k Python ints built and read back by routing).

Thread-safe: tokenizers' encode is; the cache is guarded by a lock held only for lookups
and inserts, never while tokenizing. Every encode goes through ``encode_batch`` (or
``encode_batch_fast`` where no offsets are needed): unlike ``encode`` they release the GIL
for the whole of their work (a prompt tokenized in a thread leaves the event loop free),
and the fast one skips the offsets (~15 % less time; the same ids).
"""

from __future__ import annotations

import json
from array import array
from bisect import bisect_left, bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kvstream.gateway.chat_template import ChatRenderer
from kvstream.gateway.errors import TokenizeError, TokenizerConfigError
from kvstream.gateway.options import DEFAULT_CACHE_BYTES, ModelTokenizerConfig
from kvstream.gateway.prefix_cache import WORD_CUT_STRIDE, Anchors, PrefixCache, WordCuts
from kvstream.gateway.seams import PromptTokenizer

if TYPE_CHECKING:  # imported when a tokenizer is loaded: every other command starts faster
    import tokenizers

#: Token ids are u32 in every engine kvstream bridges.
MAX_TOKEN_ID = 2**32 - 1
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


#: The array typecode of a native u32 (routing reads packed ids as numpy uint32).
_U32 = next(c for c in "IL" if array(c).itemsize == 4)


def _end(offsets: tuple[int, int]) -> int:
    return offsets[1]


def _pack(ids: Sequence[int]) -> bytes:
    return array(_U32, ids).tobytes()


def _ids(parts: list[bytes]) -> np.ndarray:
    """Packed parts joined, as the uint32 array of their ids."""
    return np.frombuffer(b"".join(parts), dtype=np.uint32)


def validate_ids(prompt: Sequence[Any]) -> list[int]:
    """A token-id prompt as given, or TokenizeError naming the first bad element."""
    if len(prompt) == 0:
        raise TokenizeError("prompt is an empty list of token ids")
    out = list(prompt)
    for i, t in enumerate(out):
        if type(t) is not int or not 0 <= t <= MAX_TOKEN_ID:
            raise TokenizeError(f"prompt[{i}] = {str(t)[:40]!r}: token ids must be integers in [0, 2**32)")
    return out


# -- loading -------------------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TokenizerConfigError(f"cannot read {path}: {exc}") from None
    if not isinstance(doc, dict):
        raise TokenizerConfigError(f"{path}: expected a JSON object")
    return doc


def _token_text(value: Any) -> str | None:
    """A special token of tokenizer_config.json: a string or an AddedToken object."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _templates(raw: Any, where: str) -> dict[str, str]:
    """``chat_template`` as a name → template map (``default`` for a single one)."""
    if raw is None:
        return {}
    if isinstance(raw, str):
        return {"default": raw}
    if isinstance(raw, list) and all(
        isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str) for t in raw
    ):
        return {t["name"]: t["template"] for t in raw}
    raise TokenizerConfigError(f"{where}: chat_template must be a string or a list of {{name, template}}")


@dataclass(frozen=True, slots=True)
class LoadedTokenizer:
    tokenizer: tokenizers.Tokenizer
    config: dict[str, Any]
    #: Chat templates by name (``default``, ``tool_use``, ...); empty: no chat.
    templates: dict[str, str]
    source: str


def load(cfg: ModelTokenizerConfig) -> LoadedTokenizer:
    """Read a model's tokenizer files; TokenizerConfigError says which file is wrong."""
    import tokenizers

    path = Path(cfg.tokenizer)
    if path.is_dir():
        tok_file, conf_file, jinja_file = path / "tokenizer.json", path / "tokenizer_config.json", path / "chat_template.jinja"
    elif path.is_file():
        tok_file, conf_file, jinja_file = path, None, None
    else:
        raise TokenizerConfigError(f"model {cfg.name}: tokenizer {path} is neither a directory nor a file")
    if not tok_file.is_file():
        raise TokenizerConfigError(f"model {cfg.name}: {tok_file} does not exist")
    try:
        tok = tokenizers.Tokenizer.from_file(str(tok_file))
    except Exception as exc:  # the Rust side reports bad files as plain Exceptions
        raise TokenizerConfigError(f"model {cfg.name}: cannot load {tok_file}: {exc}") from None
    config = _read_json(conf_file) if conf_file is not None and conf_file.is_file() else {}
    templates = _templates(config.get("chat_template"), str(conf_file))
    if jinja_file is not None and jinja_file.is_file():
        templates = {**templates, "default": jinja_file.read_text(encoding="utf-8")}
    if cfg.chat_template is not None:
        try:
            templates = {**templates, "default": Path(cfg.chat_template).read_text(encoding="utf-8")}
        except (OSError, UnicodeDecodeError) as exc:
            raise TokenizerConfigError(f"model {cfg.name}: cannot read chat template {cfg.chat_template}: {exc}") from None
    return LoadedTokenizer(tok, config, templates, str(tok_file))

# -- the local tokenizer ---------------------------------------------------------------


class LocalTokenizer(PromptTokenizer):
    """One model's tokenizer and chat template, with the prefix cache."""

    def __init__(self, loaded: LoadedTokenizer, *, cache_bytes: int = DEFAULT_CACHE_BYTES, name: str = "",
                 word_cut_stride: int = WORD_CUT_STRIDE) -> None:
        self.name = name
        self.source = loaded.source
        tok = loaded.tokenizer
        tok.no_truncation()
        tok.no_padding()
        tok.encode_special_tokens = False
        self._tok = tok
        special = {k: t for k in _SPECIAL_TOKEN_KEYS if (t := _token_text(loaded.config.get(k))) is not None}
        self.renderer = ChatRenderer(loaded.templates, special)
        self._anchors = Anchors(tok)
        self._words = WordCuts.proven_for(tok, word_cut_stride)
        self.cache = PrefixCache(cache_bytes) if cache_bytes > 0 else None
        wrap = self._special_wrap()
        self._wrap = None if wrap is None else (_pack(wrap[0]), _pack(wrap[1]))

    @classmethod
    def from_config(cls, cfg: ModelTokenizerConfig) -> LocalTokenizer:
        return cls(load(cfg), cache_bytes=cfg.prefix_cache_bytes, name=cfg.name)

    def _special_wrap(self) -> tuple[list[int], list[int]] | None:
        """(head, tail) such that ids with special tokens = head + ids without + tail, as
        the post-processor adds them; None when it does something else (then completion
        text is always tokenized whole)."""
        tok = self._tok
        bare = tok.encode("a", add_special_tokens=False).ids
        full = tok.encode("a", add_special_tokens=True).ids
        for i in range(len(full) - len(bare) + 1):
            if full[i:i + len(bare)] == bare:
                head, tail = full[:i], full[i + len(bare):]
                break
        else:
            return None
        for probe in ("hello world", "12 <x>\n"):
            b = tok.encode(probe, add_special_tokens=False).ids
            if tok.encode(probe, add_special_tokens=True).ids != head + b + tail:
                return None
        return head, tail

    # -- PromptTokenizer --------------------------------------------------------------

    def completion_ids(self, prompt: str | Sequence[int]) -> np.ndarray | list[int]:
        if isinstance(prompt, str):
            if self._wrap is None:
                return _ids([_pack(self._tok.encode_batch_fast([prompt], add_special_tokens=True)[0].ids)])
            head, tail = self._wrap
            return _ids([head, *self._packed(prompt), tail])
        if isinstance(prompt, (list, tuple)):
            return validate_ids(prompt)
        raise TokenizeError("prompt must be a string or a list of token ids")

    def chat_ids(self, body: Mapping[str, Any]) -> np.ndarray:
        parts = self._packed(self.renderer.render(body))
        if body.get("add_special_tokens") and self._wrap is not None:  # vLLM's chat option (default false)
            head, tail = self._wrap
            parts = [head, *parts, tail]
        return _ids(parts)

    # -- text → ids ---------------------------------------------------------------------

    def fresh_ids(self, text: str) -> list[int]:
        """``text`` tokenized whole, without special tokens added (the reference)."""
        return self._tok.encode_batch_fast([text], add_special_tokens=False)[0].ids

    def text_ids(self, text: str) -> np.ndarray:
        """``text`` without special tokens added: its longest cached prefix, and the rest
        tokenized in chunks cut at its word cuts (each on its own, all in one batch, which
        ``tokenizers`` spreads over the cores); the rest's segments are cached."""
        return _ids(self._packed(text))

    def _packed(self, text: str) -> list[bytes]:
        """text_ids' ids, as packed parts."""
        cache = self.cache
        cuts = self._anchors.boundaries(text) if cache is not None else []  # anchors serve the cache only
        if self._words is not None and len(text) > self._words.stride:
            at_anchor = {end for end, _ in cuts}
            cuts = sorted(cuts + [c for c in self._words.boundaries(text) if c[0] not in at_anchor])
        if not cuts:
            return [_pack(self.fresh_ids(text))]
        found, node, parts, above = cache.longest(text, cuts) if cache is not None else (0, 0, [], [])
        start, sentinel = cuts[found - 1] if found else (0, "")
        rest = cuts[found:]
        if cache is not None and self._words is not None:
            start, sentinel, node, rest = self._branch(cache, text, start, sentinel, node, rest, parts, above)
        # (from, to, the anchors in it): chunks of the rest, each ending at a word cut or the end.
        chunks: list[tuple[int, int, list[tuple[int, str]]]] = []
        inside: list[tuple[int, str]] = []
        for end, anchor in rest:
            if anchor:
                inside.append((end, anchor))
            else:
                chunks.append((chunks[-1][1] if chunks else start, end, inside))
                inside = []
        chunks.append((chunks[-1][1] if chunks else start, len(text), inside))
        encoded = self._encode_chunks(text, chunks, sentinel)
        # The sentinel (the anchor the rest follows) must come back as its own token, at its place.
        first_ids, first_offsets = encoded[0]
        if sentinel and (not first_ids or first_ids[0] != self._anchors.ids[sentinel]
                         or first_offsets is None or first_offsets[0] != (0, len(sentinel))):
            if cache is not None:
                cache.fallback()
            return [_pack(self.fresh_ids(text))]
        pieces: list[tuple[str, bytes]] = []
        caching, seg_start = cache is not None, start
        for n, ((a, b, anchors), (chunk_ids, offsets)) in enumerate(zip(chunks, encoded)):
            skip = 1 if n == 0 and sentinel else 0
            shift = a - (len(sentinel) if n == 0 else 0)
            packed = _pack(chunk_ids)
            i = piece_start = skip
            for end, anchor in anchors if caching else ():
                # Rule 3: the anchor's own id at its offsets, or nothing more is cached.
                tid, want = self._anchors.ids[anchor], (end - len(anchor) - shift, end - shift)
                i = bisect_left(offsets, want[1], i, key=_end)
                if i >= len(chunk_ids) or chunk_ids[i] != tid or offsets[i] != want:
                    caching = False
                    break
                i += 1
                pieces.append((text[seg_start:end], packed[4 * piece_start:4 * i]))
                seg_start, piece_start = end, i
            if caching and b < len(text):  # the word cut that ends the chunk
                pieces.append((text[seg_start:b], packed[4 * piece_start:]))
                seg_start = b
            parts.append(packed[4 * skip:] if skip else packed)
        if pieces and cache is not None:
            last = seg_start - len(pieces[-1][0])
            cache.insert(node, pieces, above, text[last:last + 2 * self._words.stride] if self._words else "")
        return parts

    def _branch(self, cache: PrefixCache, text: str, start: int, sentinel: str, node: int,
                rest: list[tuple[int, str]], parts: list[bytes], above: list[tuple[int, str]],
                ) -> tuple[int, str, int, list[tuple[int, str]]]:
        """Where ``text`` leaves the cached chain at ``node``: the part it has in common
        with the text that last left it there, up to their last word cut before the next
        cut, is a segment (the prefix cache's docstring). Found: its ids join ``parts``
        and the walk goes on below it; else the cut is added, so that the part is
        tokenized and cached on its own. (start, sentinel, node, rest) from there."""
        words = self._words
        assert words is not None
        at = above[-1] if above else None  # the segment of ``node`` (None: the root)
        shared = cache.shared_after(at, text, start, 2 * words.stride)
        limit = (rest[0][0] if rest else len(text)) - 1
        # A part cut here before, if this text has it too (the longest first).
        for length in sorted(cache.branches(at), reverse=True):
            cut = start + length
            if cut <= limit and words.is_cut(text, cut) and (seg := cache.segment(key := (node, text[start:cut]))):
                break
        else:
            cut = words.last_within(text, start, min(start + shared, limit)) if shared else None
            if cut is None:
                return start, sentinel, node, rest
            cache.add_branch(at, cut - start)
            return start, sentinel, node, [(cut, ""), *rest]
        parts.append(seg.ids)
        above.append(key)
        found, node, more, keys = cache.longest(text, rest, seg.node, cut, above)
        parts.extend(more)
        above.extend(keys)
        start, sentinel = rest[found - 1] if found else (cut, "")
        return start, sentinel, node, rest[found:]

    def _encode_chunks(self, text: str, chunks: list[tuple[int, int, list[tuple[int, str]]]],
                       sentinel: str) -> list[tuple[list[int], list[tuple[int, int]] | None]]:
        """Each chunk's (ids, offsets): offsets only where anchors are checked (the first
        chunk behind its sentinel, chunks with anchors), the others without (faster)."""
        out: list[tuple[list[int], list[tuple[int, int]] | None]] = [([], None)] * len(chunks)
        checked = [n for n, (_, _, anchors) in enumerate(chunks) if anchors or (n == 0 and sentinel)]
        plain = [n for n, (_, _, anchors) in enumerate(chunks) if not (anchors or (n == 0 and sentinel))]
        if checked:
            encs = self._tok.encode_batch(
                [(sentinel if n == 0 else "") + text[chunks[n][0]:chunks[n][1]] for n in checked], add_special_tokens=False)
            for n, enc in zip(checked, encs):
                out[n] = (enc.ids, enc.offsets)
        if plain:
            encs = self._tok.encode_batch_fast([text[chunks[n][0]:chunks[n][1]] for n in plain], add_special_tokens=False)
            for n, enc in zip(plain, encs):
                out[n] = (enc.ids, None)
        return out


def local_tokenizers(models: Sequence[ModelTokenizerConfig]) -> dict[str, LocalTokenizer]:
    """Each configured model's tokenizer, by model name (files are read now: a bad one
    fails the start, with TokenizerConfigError)."""
    out: dict[str, LocalTokenizer] = {}
    for cfg in models:
        if cfg.name in out:
            raise TokenizerConfigError(f"model {cfg.name} is configured twice in [[gateway.models]]")
        out[cfg.name] = LocalTokenizer.from_config(cfg)
    return out
