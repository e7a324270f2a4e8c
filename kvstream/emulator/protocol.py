"""vLLM's OpenAI-compatible request fields and response shapes, for the emulator.

Requests are checked as vLLM checks them (a wrong type, a prompt over the model length,
``stream_options`` without ``stream``: 400 with the OpenAI error body); sampling fields
(temperature, top_p, stop, ...) are accepted and have no effect (output tokens are
placeholders); what placeholders cannot honour (log probabilities, echo, beam search,
structured output) is refused by name. The output is always
``max_tokens`` long: placeholders are never an end-of-sequence token, so ``min_tokens``
and ``ignore_eos`` change nothing, and ``finish_reason`` is ``length``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvstream.emulator.errors import RequestError
from kvstream.emulator.tokenizer import EngineTokenizer


@dataclass(frozen=True, slots=True)
class Generation:
    """A checked completion or chat request."""

    chat: bool
    model: str
    prompt: list[int]
    max_tokens: int
    min_tokens: int
    ignore_eos: bool
    stream: bool
    include_usage: bool
    cache_salt: str | None
    request_id: str
    created: int


def _typed(body: Mapping[str, Any], name: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    # bool is an int in Python; vLLM's pydantic models refuse true for an integer field.
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise RequestError(f"{name} must be of type {names}, got {value!r}", param=name)
    return value


def _token_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _prompt(body: Mapping[str, Any], tokenizer: EngineTokenizer) -> list[int]:
    if "prompt" not in body or body["prompt"] is None:
        raise RequestError("Either prompt or prompt_embeds must be provided and non-empty.", param="prompt")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and (isinstance(prompt[0], str) or _token_list(prompt[0])):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        ids = tokenizer.completion_ids(prompt)
    elif _token_list(prompt):
        ids = list(prompt)
    elif isinstance(prompt, list):
        raise RequestError("the emulator serves one prompt per request (send a batch as separate requests)",
                           param="prompt")
    else:
        raise RequestError("prompt must be a string, a list of token ids, or a list of one of them", param="prompt")
    if not ids:
        raise RequestError("The prompt cannot be empty.", param="prompt")
    vocab = tokenizer.vocab_size
    if any(t < 0 or t >= vocab for t in ids):
        raise RequestError(f"Token id out of vocabulary (0 to {vocab - 1})", param="prompt")
    return ids


def _refuse_unsupported(body: Mapping[str, Any]) -> None:
    """What placeholder tokens cannot honour is refused by name, never silently ignored:
    log probabilities, echo, beam search, structured output."""
    wanted = {
        "logprobs": body.get("logprobs") not in (None, False),
        "top_logprobs": body.get("top_logprobs") not in (None, 0),
        "prompt_logprobs": body.get("prompt_logprobs") is not None,
        "echo": bool(body.get("echo")),
        "use_beam_search": bool(body.get("use_beam_search")),
        "best_of": body.get("best_of") not in (None, 1),
        "suffix": body.get("suffix") is not None,
        "response_format": isinstance(body.get("response_format"), Mapping)
        and body["response_format"].get("type") not in (None, "text"),
        "structured_outputs": body.get("structured_outputs") is not None,
    }
    for name, asked in wanted.items():
        if asked:
            raise RequestError(f"{name} is not supported by the emulated engine (its output tokens are "
                               "placeholders)", param=name)


def parse(body: Any, *, chat: bool, served: str, max_model_len: int, tokenizer: EngineTokenizer,
          request_id: str | None = None) -> Generation:
    """``request_id``: the ``X-Request-Id`` header, which vLLM's ids are made from (a
    disaggregating router sends the same one to both legs)."""
    if not isinstance(body, Mapping):
        raise RequestError("the request body must be a JSON object")
    model = _typed(body, "model", str, served)
    if model != served:
        raise RequestError(f"The model `{model}` does not exist.", param="model", status=404, err_type="NotFoundError")
    stream = _typed(body, "stream", bool, False)
    options = _typed(body, "stream_options", Mapping)
    if options is not None and not stream:
        raise RequestError("Stream options can only be defined when `stream=True`.", param="stream_options")
    include_usage = bool(options and _typed(options, "include_usage", bool, False))
    if _typed(body, "n", int, 1) != 1:
        raise RequestError("the emulator makes one choice per request (n must be 1)", param="n")
    _refuse_unsupported(body)
    salt = _typed(body, "cache_salt", str)
    if salt == "":
        raise RequestError("Parameter 'cache_salt' must be a non-empty string if provided.", param="cache_salt")
    ids = tokenizer.chat_ids(body) if chat else _prompt(body, tokenizer)
    field = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    requested = _typed(body, field, int)
    min_tokens = _typed(body, "min_tokens", int, 0)
    ignore_eos = _typed(body, "ignore_eos", bool, False)
    if len(ids) >= max_model_len:
        raise RequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt contains "
            f"{len(ids)} input tokens, which exceeds this limit even without any output tokens. "
            "Please reduce the length of the input prompt.", param="input_tokens")
    if requested is None:
        max_tokens = max_model_len - len(ids)
    else:
        if requested < 1:
            raise RequestError(f"{field} must be at least 1, got {requested}.", param=field)
        if len(ids) + requested > max_model_len:
            raise RequestError(
                f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                f"{requested} output tokens and your prompt contains {len(ids)} input tokens, for a total of "
                f"{len(ids) + requested} tokens. Please reduce the length of the input prompt or the number "
                "of requested output tokens.", param=field)
        max_tokens = requested
    if min_tokens < 0 or min_tokens > max_tokens:
        raise RequestError(f"min_tokens must be between 0 and max_tokens={max_tokens}, got {min_tokens}.",
                           param="min_tokens")
    prefix = "chatcmpl" if chat else "cmpl"
    return Generation(chat, model, ids, max_tokens, min_tokens, ignore_eos, stream, include_usage, salt,
                      f"{prefix}-{request_id or uuid.uuid4().hex}", int(time.time()))


# -- responses --------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens, "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def _head(g: Generation, chunk: bool) -> dict[str, Any]:
    kind = ("chat.completion" if g.chat else "text_completion") + (".chunk" if chunk and g.chat else "")
    return {"id": g.request_id, "object": kind, "created": g.created, "model": g.model}


def response(g: Generation, text: str, completion_tokens: int, cached_tokens: int,
             kv_transfer_params: dict[str, Any] | None = None) -> dict[str, Any]:
    """The whole answer of a request that did not stream (``kv_transfer_params``: a
    disaggregated prefill leg's, for its decode leg)."""
    if g.chat:
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text, "refusal": None, "annotations": None, "audio": None,
                        "function_call": None, "tool_calls": [], "reasoning_content": None},
            "logprobs": None, "finish_reason": "length", "stop_reason": None,
        }
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length", "stop_reason": None,
                  "prompt_logprobs": None}
    return {**_head(g, False), "choices": [choice], "service_tier": None, "system_fingerprint": None,
            "usage": usage(len(g.prompt), completion_tokens, cached_tokens),
            "kv_transfer_params": kv_transfer_params}


def chunk(g: Generation, text: str, finished: bool, *, first: bool = False) -> dict[str, Any]:
    """One streamed chunk of output text (the last one carries ``finish_reason``)."""
    reason = "length" if finished else None
    if g.chat:
        delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
    if finished:
        choice["stop_reason"] = None
    return {**_head(g, True), "choices": [choice]}


def usage_chunk(g: Generation, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """The last chunk when ``stream_options.include_usage``: no choice, the usage."""
    return {**_head(g, True), "choices": [], "usage": usage(len(g.prompt), completion_tokens, cached_tokens)}


def render(g: Generation) -> dict[str, Any]:
    """What ``/v1/*/render`` answers for one prompt: vLLM's ``GenerateRequest`` (the
    fields a token-in generate server needs; no multimodal features here)."""
    return {
        "request_id": g.request_id, "token_ids": g.prompt, "token_offsets": None, "features": None,
        "sampling_params": {"n": 1, "max_tokens": g.max_tokens, "min_tokens": g.min_tokens,
                            "ignore_eos": g.ignore_eos},
        "model": g.model, "stream": g.stream,
        "stream_options": {"include_usage": g.include_usage} if g.stream else None,
        "cache_salt": g.cache_salt, "priority": 0,
    }


def model_list(model: str, max_model_len: int, created: int) -> dict[str, Any]:
    return {"object": "list", "data": [{
        "id": model, "object": "model", "created": created, "owned_by": "vllm", "root": model, "parent": None,
        "max_model_len": max_model_len,
        "permission": [{
            "id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission", "created": created,
            "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
            "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False, "organization": "*",
            "group": None, "is_blocking": False,
        }],
    }]}
