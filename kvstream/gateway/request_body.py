"""What the gateway reads of an OpenAI request body: ``model``, ``stream``, and the
prompt (``prompt`` or ``messages``). The worker gets the bytes the client sent, but for
one change: a completions prompt of text may go as the token ids it was routed by
(:func:`with_prompt_ids`, ``[gateway] send_token_ids``). This checks the fields routing
needs, and says what is wrong with them in OpenAI's error format (kvstream.gateway.errors)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

import numpy as np
import orjson

from kvstream.gateway.errors import bad_request

#: Token ids are u32.
TOKEN_END = 1 << 32


class Endpoint(StrEnum):
    """The OpenAI endpoints the gateway relays, named by their path."""

    COMPLETIONS = "/v1/completions"
    CHAT = "/v1/chat/completions"
    EMBEDDINGS = "/v1/embeddings"


@dataclass(frozen=True, slots=True)
class OpenAIRequest:
    endpoint: Endpoint
    #: The decoded body (read only: the worker gets the raw bytes, or those of
    #: :func:`with_prompt_ids`; its prompt may then be a uint32 array: :func:`dumps`).
    body: dict[str, Any]
    model: str
    stream: bool


def parse(raw: bytes, endpoint: Endpoint) -> OpenAIRequest:
    """The request's routing fields; ApiError (400) saying what is wrong."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"the body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request(f"the body must be a JSON object, got {type(body).__name__}")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("`model` is required: the name of a served model (see GET /v1/models)", "model")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise bad_request(f"`stream` must be a boolean, got {type(stream).__name__}", "stream")
    if endpoint is Endpoint.COMPLETIONS:
        _check_prompt(body.get("prompt"))
    elif endpoint is Endpoint.CHAT:
        _check_messages(body.get("messages"))
    elif "input" not in body:
        raise bad_request("`input` is required", "input")
    return OpenAIRequest(endpoint, body, model, bool(stream))


def dumps(body: dict[str, Any]) -> bytes:
    """A request body as JSON for a worker (token ids in a numpy array as a list)."""
    return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)


def ids_replace_prompt(req: OpenAIRequest) -> bool:
    """Whether the worker may get the prompt as the ids it was routed by, to the same
    effect: one text prompt of a completions request, whose answer does not repeat it
    (``echo``) and whose ids keep the special tokens the engine adds to text (as the
    gateway's do); an engine takes ids as they are."""
    body = req.body
    return (req.endpoint is Endpoint.COMPLETIONS and type(body.get("prompt")) is str and not body.get("echo")
            and body.get("add_special_tokens", True) is not False)


def with_prompt_ids(req: OpenAIRequest, ids: Sequence[int] | np.ndarray) -> tuple[OpenAIRequest, bytes]:
    """``req`` with ``ids`` in place of its text prompt, and its body's bytes."""
    body = {**req.body, "prompt": ids}
    return replace(req, body=body), dumps(body)


def is_token_ids(value: object) -> bool:
    return type(value) is list and all(type(t) is int and 0 <= t < TOKEN_END for t in value)


def _check_prompt(prompt: object) -> None:
    if isinstance(prompt, str):
        return
    if type(prompt) is list and prompt:
        if all(type(t) is int for t in prompt):
            if not is_token_ids(prompt):
                raise bad_request("token ids of `prompt` must be integers in [0, 2**32)", "prompt")
            return
        if all(isinstance(p, str) for p in prompt) or all(is_token_ids(p) and p for p in prompt):
            return
    raise bad_request(
        "`prompt` must be a string, a non-empty list of token ids, or a non-empty list of either", "prompt"
    )


def _check_messages(messages: object) -> None:
    if type(messages) is not list or not messages:
        raise bad_request("`messages` must be a non-empty list of messages", "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad_request(f"`messages[{i}]` must be an object with a string `role`", "messages")
