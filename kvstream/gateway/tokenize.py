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
- :class:`EngineTokenizer`: asks one worker's ``/tokenize`` (vLLM's API) instead.

**The prefix cache.** Conversations and agents resend the same system prompt and earlier
turns; their ids are cached per *segment*, a piece of text that ends right after an
added token (``<|im_end|>``, ``<｜User｜>``...). HF ``tokenizers`` splits the text on
added tokens before anything else, so such a boundary is hard, provided that:

1. the token is matched on the raw text (``normalized=False``), does not swallow what
   follows (``rstrip=False``, ``single_word=False``) and does not end in whitespace (an
   ``lstrip`` token after it must not reach into it);
2. no added token could start inside the prefix and run past the boundary in some other
   continuation: no proper prefix of any added token is a suffix of the text before the
   boundary (checked on the actual text, for every boundary);
3. the tokenizer's own encoding put that very token there (its id at exactly those
   offsets; checked when a segment is cached).

The text after a cached boundary is tokenized behind the same added token (then dropped),
so that it is tokenized as a non-first piece, exactly as in the whole text. A segment is
keyed by its exact text and the node of the segment before it (a chain: the key holds
the whole prefix, compared as text, never by hash); each cache belongs to one tokenizer
instance. ``tests/gateway/test_tokenize.py`` proves ids with the cache equal ids without
on random conversations and texts (hypothesis). The cache is an LRU bounded in bytes.

Thread-safe: tokenizers' encode is; the cache is guarded by a lock held only for lookups
and inserts, never while tokenizing.
"""

from __future__ import annotations

import itertools
import json
import re
import sys
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from kvstream.gateway.errors import TokenizeError, TokenizerConfigError
from kvstream.gateway.seams import PromptTokenizer, WorkerDirectory

if TYPE_CHECKING:  # imported when a tokenizer is loaded: every other command starts faster
    import httpx
    import jinja2
    import tokenizers

#: Token ids are u32 in every engine kvstream bridges.
MAX_TOKEN_ID = 2**32 - 1
DEFAULT_CACHE_BYTES = 64 * 1024 * 1024
#: Keys of the render context a request's ``chat_template_kwargs`` may not replace.
_RESERVED = frozenset({"messages", "tools", "documents", "add_generation_prompt"})
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class ModelTokenizerConfig(BaseModel):
    """One ``[[gateway.models]]`` entry of the settings."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    #: The model name requests give (``model``).
    name: str = Field(min_length=1)
    #: A directory holding ``tokenizer.json`` (and ``tokenizer_config.json``), or a
    #: ``tokenizer.json`` file (then no chat template unless ``chat_template`` is set).
    tokenizer: Path
    #: A jinja chat template file, instead of the one in ``tokenizer_config.json``.
    chat_template: Path | None = None
    #: Bytes of token ids and text the prefix cache may hold; 0: no cache.
    prefix_cache_bytes: int = Field(DEFAULT_CACHE_BYTES, ge=0)


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


# -- the chat template ---------------------------------------------------------------


def _environment() -> jinja2.Environment:
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if tuple(int(p) for p in jinja2.__version__.split(".")[:3] if p.isdigit()) < (3, 1, 6):
        # Earlier versions have known sandbox escapes; chat templates are untrusted code.
        raise TokenizerConfigError(f"chat templates need jinja2 >= 3.1.6 (installed: {jinja2.__version__})")

    class GenerationTag(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` marks assistant text for training
        masks; rendering only needs its body."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        # jinja's own tojson escapes <, >, & for HTML: templates expect plain JSON.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _iterates_content(template: Any) -> bool:
    """Whether a template loops over ``message.content`` / ``message['content']`` (then
    it takes OpenAI content parts as given), as vLLM's content-format detection asks."""
    import jinja2.nodes as n

    for loop in template.find_all(n.For):
        it = loop.iter
        if isinstance(it, n.Getattr) and it.attr == "content":
            return True
        if isinstance(it, n.Getitem) and isinstance(it.arg, n.Const) and it.arg.value == "content":
            return True
    return False


def _text_content(content: Any, i: int) -> Any:
    """OpenAI content parts as a template that wants a string gets them from vLLM: the
    text parts joined by newlines."""
    if not isinstance(content, list):
        return content
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise TokenizeError(
                f"messages[{i}]: only text content parts can be tokenized here (ask the engine for others)"
            )
        texts.append(part["text"])
    return "\n".join(texts)


def _messages(body: Mapping[str, Any], parts: bool) -> list[dict[str, Any]]:
    """The body's messages as the template sees them: keys with a null value dropped (as
    transformers does), tool call arguments given as a JSON string parsed and content
    parts joined for a template that wants a string (as vLLM does)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise TokenizeError("messages must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise TokenizeError(f"messages[{i}] must be an object")
        m = {k: v for k, v in m.items() if v is not None}
        if not parts and "content" in m:
            m["content"] = _text_content(m["content"], i)
        calls = m.get("tool_calls")
        if isinstance(calls, list):
            m["tool_calls"] = [_parsed_call(c) for c in calls]
        out.append(m)
    return out


def _parsed_call(call: Any) -> Any:
    fn = call.get("function") if isinstance(call, dict) else None
    if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
        try:
            args = json.loads(fn["arguments"])
        except json.JSONDecodeError:
            return call
        if isinstance(args, dict):
            return {**call, "function": {**fn, "arguments": args}}
    return call


class ChatRenderer:
    """Renders a chat body to the text the engine tokenizes."""

    def __init__(self, templates: Mapping[str, str], special_tokens: Mapping[str, str]) -> None:
        import jinja2

        self._special = dict(special_tokens)
        env = _environment()
        self._compiled: dict[str, jinja2.Template] = {}
        #: Templates that take content parts as given (the others get joined text).
        self._parts: set[str] = set()
        for name, text in templates.items():
            try:
                self._compiled[name] = env.from_string(text)
                if _iterates_content(env.parse(text)):
                    self._parts.add(name)
            except jinja2.TemplateSyntaxError as exc:
                raise TokenizerConfigError(f"chat template {name!r} does not compile: {exc}") from None

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._compiled)

    def _template(self, body: Mapping[str, Any]) -> str:
        """The name of the template for this body."""
        named = body.get("chat_template")
        if named is not None:
            # Only a named template of the model: a request's own template would be code
            # run on the gateway.
            if not isinstance(named, str) or named not in self._compiled:
                raise TokenizeError(f"chat_template must name one of the model's templates: {sorted(self._compiled)}")
            return named
        if body.get("tools") and "tool_use" in self._compiled:
            return "tool_use"
        if "default" in self._compiled:
            return "default"
        if not self._compiled:
            raise TokenizeError("this model has no chat template: use /v1/completions")
        raise TokenizeError(f"this model has several chat templates and no default: {sorted(self._compiled)}")

    def render(self, body: Mapping[str, Any]) -> str:
        import jinja2

        name = self._template(body)
        template = self._compiled[name]
        messages = _messages(body, name in self._parts)
        kwargs = body.get("chat_template_kwargs")
        kwargs = {} if kwargs is None else kwargs
        if not isinstance(kwargs, dict):
            raise TokenizeError("chat_template_kwargs must be an object")
        if reserved := sorted(_RESERVED & kwargs.keys()):
            raise TokenizeError(f"chat_template_kwargs may not set {reserved}")
        tools = body.get("tools")
        if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
            raise TokenizeError("tools must be a list of objects")
        documents = body.get("documents")
        generation = body.get("add_generation_prompt", True)  # vLLM's default for chat
        cont = body.get("continue_final_message", False)
        if cont and generation:
            raise TokenizeError("continue_final_message and add_generation_prompt cannot both be true")
        if cont:
            last = messages[-1]
            if not isinstance(last.get("content"), str):
                raise TokenizeError("continue_final_message needs a final message with text content")
            messages[-1] = {**last, "content": last["content"] + _CONTINUE_TAG}
        try:
            text = template.render(
                **{**self._special, **kwargs}, messages=messages, tools=tools, documents=documents,
                add_generation_prompt=bool(generation),
            )
        except jinja2.TemplateError as exc:
            raise TokenizeError(f"chat template error: {exc}") from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
            # A template reading a field this body does not have the way it expects.
            raise TokenizeError(f"chat template cannot render these messages: {type(exc).__name__}: {exc}") from None
        if cont:
            # Everything the template put after the final message's text goes: the
            # engine continues that text.
            at = text.rfind(_CONTINUE_TAG.strip())
            if at < 0:
                raise TokenizeError("continue_final_message: the template does not render the final message's text")
            text = text[:at] if text.startswith(_CONTINUE_TAG, at) else text[:at].rstrip()
        return text


# -- the prefix cache ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Segment:
    node: int
    ids: tuple[int, ...]
    nbytes: int


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


class _Anchors:
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


class PrefixCache:
    """Segment chains → ids, LRU-bounded in bytes (module docstring)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self.stats = CacheStats()
        self._entries: OrderedDict[tuple[int, str], _Segment] = OrderedDict()
        self._lock = threading.Lock()
        # Node ids are never reused: a segment under an evicted parent is unreachable,
        # never attached to another prefix.
        self._next = itertools.count(1)

    def __len__(self) -> int:
        return len(self._entries)

    def longest(self, text: str, cuts: list[tuple[int, str]]) -> tuple[int, int, list[int], list[tuple[int, str]]]:
        """(cuts matched, node of the last, their ids, their keys) for the longest cached
        prefix."""
        ids: list[int] = []
        keys: list[tuple[int, str]] = []
        node, start = 0, 0
        with self._lock:
            self.stats.lookups += 1
            for end, _ in cuts:
                key = (node, text[start:end])
                seg = self._entries.get(key)
                if seg is None:
                    break
                keys.append(key)
                ids.extend(seg.ids)
                node, start = seg.node, end
            self._touch(keys)
            self.stats.hit_segments += len(keys)
            self.stats.hit_tokens += len(ids)
        return len(keys), node, ids, keys

    def _touch(self, chain: list[tuple[int, str]]) -> None:
        # A prefix's segments become the most recent, the first one last of all: the LRU
        # then evicts the ends of chains before their beginnings, never orphaning the rest.
        for key in reversed(chain):
            if key in self._entries:
                self._entries.move_to_end(key)

    def fallback(self) -> None:
        with self._lock:
            self.stats.fallbacks += 1

    def insert(self, parent: int, pieces: list[tuple[str, tuple[int, ...]]], above: list[tuple[int, str]]) -> None:
        """Add a chain of (segment text, ids) under ``parent``, the end of the chain
        ``above`` (the keys of the segments before it)."""
        chain: list[tuple[int, str]] = []
        with self._lock:
            for text, ids in pieces:
                key = (parent, text)
                seg = self._entries.get(key)
                if seg is None:
                    nbytes = sys.getsizeof(text) + 8 * len(ids) + 200  # + the tuple, key and node
                    if nbytes > self.max_bytes:
                        break
                    seg = _Segment(next(self._next), ids, nbytes)
                    self._entries[key] = seg
                    self.bytes += nbytes
                    self.stats.inserted += 1
                chain.append(key)
                parent = seg.node
            self._touch(above + chain)
            while self.bytes > self.max_bytes:
                _, old = self._entries.popitem(last=False)
                self.bytes -= old.nbytes
                self.stats.evicted += 1


# -- the local tokenizer ---------------------------------------------------------------


class LocalTokenizer(PromptTokenizer):
    """One model's tokenizer and chat template, with the prefix cache."""

    def __init__(self, loaded: LoadedTokenizer, *, cache_bytes: int = DEFAULT_CACHE_BYTES, name: str = "") -> None:
        self.name = name
        self.source = loaded.source
        tok = loaded.tokenizer
        tok.no_truncation()
        tok.no_padding()
        tok.encode_special_tokens = False
        self._tok = tok
        special = {k: t for k in _SPECIAL_TOKEN_KEYS if (t := _token_text(loaded.config.get(k))) is not None}
        self.renderer = ChatRenderer(loaded.templates, special)
        self._anchors = _Anchors(tok)
        self.cache = PrefixCache(cache_bytes) if cache_bytes > 0 else None
        self._wrap = self._special_wrap()

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

    def completion_ids(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self._wrap is None:
                return self._tok.encode(prompt, add_special_tokens=True).ids
            head, tail = self._wrap
            return head + self.text_ids(prompt) + tail
        if isinstance(prompt, (list, tuple)):
            return validate_ids(prompt)
        raise TokenizeError("prompt must be a string or a list of token ids")

    def chat_ids(self, body: Mapping[str, Any]) -> list[int]:
        text = self.renderer.render(body)
        ids = self.text_ids(text)
        if body.get("add_special_tokens"):  # vLLM's chat option (default false)
            head, tail = self._wrap if self._wrap is not None else ([], [])
            ids = head + ids + tail
        return ids

    # -- text → ids ---------------------------------------------------------------------

    def fresh_ids(self, text: str) -> list[int]:
        """``text`` tokenized whole, without special tokens added (the reference)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def text_ids(self, text: str) -> list[int]:
        """``text`` without special tokens added; through the prefix cache."""
        cache = self.cache
        if cache is None:
            return self.fresh_ids(text)
        cuts = self._anchors.boundaries(text)
        if not cuts:
            return self.fresh_ids(text)
        found, node, ids, above = cache.longest(text, cuts)
        if found:
            start, sentinel = cuts[found - 1]
        else:
            start, sentinel = 0, ""
        enc = self._tok.encode(sentinel + text[start:], add_special_tokens=False)
        rest_ids, offsets = enc.ids, enc.offsets
        skip = 0
        if sentinel:
            if not rest_ids or rest_ids[0] != self._anchors.ids[sentinel] or offsets[0] != (0, len(sentinel)):
                cache.fallback()
                return self.fresh_ids(text)
            skip = 1
        # Cut the new part at its anchors (rule 3: the anchor's own id at its offsets).
        shift = start - len(sentinel)
        pieces: list[tuple[str, tuple[int, ...]]] = []
        i, seg_start, piece_start = skip, start, skip
        for end, anchor in cuts[found:]:
            tid, want = self._anchors.ids[anchor], (end - len(anchor) - shift, end - shift)
            while i < len(rest_ids) and offsets[i][1] < want[1]:
                i += 1
            if i >= len(rest_ids) or rest_ids[i] != tid or offsets[i] != want:
                break
            i += 1
            pieces.append((text[seg_start:end], tuple(rest_ids[piece_start:i])))
            seg_start, piece_start = end, i
        if pieces:
            cache.insert(node, pieces, above)
        ids.extend(rest_ids[skip:])
        return ids


# -- asking the engine -----------------------------------------------------------------

#: Body fields of a chat request that vLLM's /tokenize takes.
_CHAT_TOKENIZE_FIELDS = (
    "messages", "add_generation_prompt", "continue_final_message", "add_special_tokens", "tools",
    "chat_template", "chat_template_kwargs", "documents",
)


class EngineTokenizer(PromptTokenizer):
    """Asks one worker of the model (round robin over those registered) for the ids:
    vLLM's ``POST /tokenize`` ({"model","prompt"} or {"model","messages",...} →
    {"tokens"}). One worker per prompt, never all; a failure is a TokenizeError."""

    def __init__(self, directory: WorkerDirectory, model: str, *, timeout_s: float = 10.0,
                 client: httpx.Client | None = None) -> None:
        import httpx

        self.model = model
        self._directory = directory
        self._client = client or httpx.Client(timeout=timeout_s)
        self._turn = itertools.count()

    def _ask(self, payload: dict[str, Any]) -> list[int]:
        import httpx

        serving = [ep for ep in self._directory.endpoints() if ep.serves(self.model)]
        if not serving:
            raise TokenizeError(f"no registered worker serves model {self.model!r} to tokenize with")
        ep = serving[next(self._turn) % len(serving)]
        headers = {"Authorization": f"Bearer {ep.api_key}"} if ep.api_key else {}
        try:
            r = self._client.post(f"{ep.url}/tokenize", json=payload, headers=headers)
        except httpx.HTTPError as exc:
            raise TokenizeError(f"worker {ep.worker_id} ({ep.url}) could not tokenize: {type(exc).__name__}: {exc}") from None
        if r.status_code != 200:
            raise TokenizeError(
                f"worker {ep.worker_id} ({ep.url}) answered /tokenize with {r.status_code}: {r.text[:300]}"
            )
        try:
            tokens = r.json()["tokens"]
            if not isinstance(tokens, list):
                raise TypeError("tokens is not a list")
            return validate_ids(tokens) if tokens else []
        except (ValueError, KeyError, TypeError, TokenizeError) as exc:
            raise TokenizeError(f"worker {ep.worker_id} ({ep.url}) sent a bad /tokenize answer: {exc}") from None

    def completion_ids(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            return self._ask({"model": self.model, "prompt": prompt, "add_special_tokens": True})
        if isinstance(prompt, (list, tuple)):
            return validate_ids(prompt)
        raise TokenizeError("prompt must be a string or a list of token ids")

    def chat_ids(self, body: Mapping[str, Any]) -> list[int]:
        payload = {k: body[k] for k in _CHAT_TOKENIZE_FIELDS if k in body}
        payload["model"] = self.model
        return self._ask(payload)

    def close(self) -> None:
        self._client.close()


def local_tokenizers(models: Sequence[ModelTokenizerConfig]) -> dict[str, LocalTokenizer]:
    """Each configured model's tokenizer, by model name (files are read now: a bad one
    fails the start, with TokenizerConfigError)."""
    out: dict[str, LocalTokenizer] = {}
    for cfg in models:
        if cfg.name in out:
            raise TokenizerConfigError(f"model {cfg.name} is configured twice in [[gateway.models]]")
        out[cfg.name] = LocalTokenizer.from_config(cfg)
    return out
