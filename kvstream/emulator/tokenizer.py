"""Prompt token ids for the emulated engine (the gateway's ``PromptTokenizer`` seam).

With ``--tokenizer PATH`` a local HF ``tokenizer.json`` tokenizes text (special tokens
added, as vLLM does for completions), and ``--chat-template PATH`` (a Jinja template, as
vLLM's ``--chat-template``) renders chat messages first. Without a tokenizer the fallback
is deterministic and documented, not a real model's: text is cut into words with their
leading whitespace, each word's id is its xxh3 hash modulo the vocabulary; chat
messages without a template are rendered as ``<|role|>\\ncontent\\n`` lines followed by
``<|assistant|>\\n``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import xxhash

from kvstream.emulator.errors import EmulatorConfigError, RequestError

_WORDS = re.compile(r"\s*\S+|\s+")
#: Vocabulary of the fallback tokenizer (Llama 3's size).
FALLBACK_VOCAB = 128_256


def _content(message: Mapping[str, Any], i: int) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(f"messages[{i}].content: only text parts are supported", param="messages")
            parts.append(part["text"])
        return "".join(parts)
    raise RequestError(f"messages[{i}].content must be a string or a list of parts", param="messages")


def _messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise RequestError(f"messages[{i}] must be an object with a string role", param="messages")
        out.append({**m, "content": _content(m, i)})
    return out


class EngineTokenizer:
    """Text → ids as the emulated engine computes them; ids → text for the output."""

    def __init__(self, tokenizer: Path | None = None, chat_template: Path | None = None) -> None:
        self._hf: Any = None
        self._template: Any = None
        if tokenizer is not None:
            from tokenizers import Tokenizer

            try:
                self._hf = Tokenizer.from_file(str(tokenizer))
            except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception for a bad file
                raise EmulatorConfigError(f"cannot load the tokenizer {tokenizer}: {exc}") from None
        if chat_template is not None:
            from jinja2 import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            try:
                self._template = env.from_string(chat_template.read_text())
            except (OSError, TemplateError) as exc:
                raise EmulatorConfigError(f"cannot read the chat template {chat_template}: {exc}") from None

        # Read once: tokenizers counts the vocabulary on every call (40 µs), and every
        # prompt token is checked against it.
        self._vocab_size = self._hf.get_vocab_size() if self._hf is not None else FALLBACK_VOCAB

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def encode(self, text: str, special: bool) -> list[int]:
        if self._hf is not None:
            return list(self._hf.encode(text, add_special_tokens=special).ids)
        return [xxhash.xxh3_64_intdigest(w.encode()) % FALLBACK_VOCAB for w in _WORDS.findall(text)]

    def completion_ids(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.encode(prompt, True)
        return list(prompt)

    def render_chat(self, body: Mapping[str, Any]) -> str:
        messages = _messages(body)
        add_generation_prompt = body.get("add_generation_prompt", True)
        if self._template is None:
            text = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)
            return text + "<|assistant|>\n" if add_generation_prompt else text
        from jinja2 import TemplateError

        def raise_exception(message: str) -> None:
            raise RequestError(f"chat template: {message}", param="messages")

        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, Mapping):
            raise RequestError("chat_template_kwargs must be an object", param="chat_template_kwargs")
        try:
            return str(self._template.render(
                **kwargs, messages=messages, add_generation_prompt=add_generation_prompt,
                tools=body.get("tools"), bos_token="", eos_token="", raise_exception=raise_exception,
            ))
        except TemplateError as exc:
            raise RequestError(f"chat template: {exc}", param="messages") from None

    def chat_ids(self, body: Mapping[str, Any]) -> list[int]:
        # The template writes the special tokens itself (vLLM adds none to chat prompts).
        return self.encode(self.render_chat(body), False)

    def decode(self, ids: Sequence[int]) -> str:
        if self._hf is not None:
            return str(self._hf.decode(list(ids), skip_special_tokens=False))  # placeholders stay visible
        return " x" * len(ids)
