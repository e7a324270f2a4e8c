"""What the gateway reads of an OpenAI request body: ``model``, ``stream``, and the
prompt (``prompt`` or ``messages``). The body itself is never re-encoded: the worker
gets the bytes the client sent; this only checks the fields routing needs, and says
what is wrong with them in OpenAI's error format (kvstream.gateway.errors)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

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
    #: The decoded body (read only: the worker gets the raw bytes).
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
