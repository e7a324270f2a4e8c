"""The token ids a request is routed by: ids the client sent are used as given; text is
tokenized by the model's local tokenizer (kvstream.gateway.seams.PromptTokenizer, off the
event loop when long), or, with ``tokenize = "engine"`` or with ``"auto"`` (the default)
for a model that has no local tokenizer, by the ``/tokenize`` endpoint of one candidate
engine (vLLM's and SGLang's; one worker asked, never all: its answer's ids are read by
the compiled core straight into packed u32s, which routing reads as they are).

Whether the ids may go to the worker in place of the text (``[gateway] send_token_ids``)
is decided here too: an engine's ids are its own; a local tokenizer's are sent once an
engine's ``/tokenize`` has given the same ids for one prompt of the model (checked on
the model's first text prompt that could go as ids, once per gateway)."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import anyio
import numpy as np
import orjson

from kvstream import _native
from kvstream.gateway.errors import (
    ApiError,
    UpstreamError,
    bad_request,
    upstream_failed,
)
from kvstream.gateway.options import GatewayOptions
from kvstream.gateway.request_body import Endpoint, OpenAIRequest, ids_replace_prompt
from kvstream.gateway.seams import PromptTokenizer, WorkerEndpoint
from kvstream.gateway.upstream import UpstreamPool
from kvstream.logs import get_logger
from kvstream.router.core import PromptTokens

#: Fields of a chat body that change its rendering (vLLM's TokenizeChatRequest takes them).
_CHAT_FIELDS = ("messages", "tools", "add_generation_prompt", "continue_final_message",
                "chat_template", "chat_template_kwargs", "add_special_tokens")
_JSON = (b"content-type", b"application/json")

log = get_logger(__name__)

#: Seconds before an engine that could not confirm a local tokenizer (down, 5xx) is
#: asked again: meanwhile prompts go as text, with no extra round trip.
RECHECK_AFTER_S = 30.0


class _EngineDown(Exception):
    """An engine that could not tokenize (unreachable, 5xx): another may."""

    def __init__(self, error: ApiError) -> None:
        super().__init__(error.message)
        self.error = error


class PromptIds:
    def __init__(self, tokenizers: Mapping[str, PromptTokenizer], options: GatewayOptions) -> None:
        self.tokenizers, self.options = tokenizers, options
        #: Model → whether an engine's /tokenize gave its local tokenizer's ids (False also
        #: when it cannot say; absent: not asked yet, or the engine asked was down).
        self._agrees: dict[str, bool] = {}
        #: Models whose check is under way (one request asks; the others send text meanwhile).
        self._checking: set[str] = set()
        #: Model → when an engine that could not answer (down, 5xx) may be asked again.
        self._ask_after: dict[str, float] = {}

    def given(self, req: OpenAIRequest) -> list[int] | None:
        """The ids the client sent (the first prompt of a batch routes it), else None."""
        if req.endpoint is not Endpoint.COMPLETIONS:
            return None
        prompt = req.body["prompt"]
        # parse() has checked the prompt: a list is all ids, all texts or all lists of ids.
        if type(prompt) is not list:
            return None
        first = prompt[0]
        return first if type(first) is list else prompt if type(first) is int else None

    async def ids(
        self, req: OpenAIRequest, size: int, endpoints: Sequence[WorkerEndpoint], upstream: UpstreamPool
    ) -> tuple[PromptTokens, bool]:
        """The request's token ids (``size``: the body's bytes, how long tokenizing may take):
        a list, or a uint32 array; and whether the worker is to get them in place of the
        prompt's text (the module's docstring)."""
        given = self.given(req)
        if given is not None:
            return given, False
        mode = self.options.tokenize
        tokenizer = None if mode == "engine" else self._tokenizer(req.model, endpoints)
        sendable = self.options.send_token_ids and ids_replace_prompt(req)
        if tokenizer is None and mode != "local":
            return await self._asked(req, endpoints, upstream), sendable
        ids = await self._local(req, size, tokenizer)
        return ids, sendable and await self._agreed(req, ids, endpoints, upstream)

    async def _asked(self, req: OpenAIRequest, endpoints: Sequence[WorkerEndpoint], upstream: UpstreamPool) -> np.ndarray:
        """The ids of one engine's /tokenize; another asked only when it cannot answer
        (down, 5xx), as a request is retried elsewhere: at most 1 + retries of them."""
        failure: ApiError | None = None
        for ep in endpoints[: 1 + self.options.retries]:
            try:
                return await self._engine_ids(req, ep, upstream)
            except _EngineDown as exc:
                failure = exc.error
        assert failure is not None
        raise failure

    async def _agreed(self, req: OpenAIRequest, ids: PromptTokens, endpoints: Sequence[WorkerEndpoint],
                      upstream: UpstreamPool) -> bool:
        """Whether the model's local tokenizer gives the engines' ids: asked of one engine
        the first time (a request meanwhile sends its text)."""
        model = req.model
        known = self._agrees.get(model)
        if known is not None or model in self._checking or time.monotonic() < self._ask_after.get(model, 0.0):
            return bool(known)
        self._checking.add(model)
        try:
            theirs = await self._engine_ids(req, endpoints[0], upstream)
        except _EngineDown:
            self._ask_after[model] = time.monotonic() + RECHECK_AFTER_S
            return False
        except ApiError as exc:  # it cannot say (no /tokenize, a refusal, no ids): text from now on
            self._agrees[model] = False
            log.warning("prompts go to the engines as text: no engine confirmed the local tokenizer",
                        model=model, reason=exc.message)
            return False
        finally:
            self._checking.discard(model)
        agrees = self._agrees[model] = bool(np.array_equal(np.asarray(ids, dtype=np.int64), theirs))
        if not agrees:
            log.warning("prompts go to the engines as text: the local tokenizer's ids differ from an engine's /tokenize "
                        "(is [[gateway.models]] tokenizer the model's?)", model=model, local_tokens=len(ids),
                        engine_tokens=len(theirs))
        return agrees

    async def _local(self, req: OpenAIRequest, size: int, tokenizer: PromptTokenizer | None) -> PromptTokens:
        if tokenizer is None:
            raise bad_request(
                f"no tokenizer is configured for model {req.model!r}: send `prompt` as token ids, configure the "
                "model's tokenizer, or set [gateway] tokenize = \"auto\" or \"engine\"", "model", "no_tokenizer",
            )
        if req.endpoint is Endpoint.CHAT:
            work, arg = tokenizer.chat_ids, req.body
        else:
            prompt = req.body["prompt"]
            work, arg = tokenizer.completion_ids, prompt if isinstance(prompt, str) else prompt[0]
        try:
            if size <= self.options.inline_tokenize_bytes:
                return work(arg)
            return await anyio.to_thread.run_sync(work, arg)
        except (ValueError, TypeError, KeyError) as exc:  # a template that cannot render these messages
            raise bad_request(f"the prompt cannot be tokenized for {req.model!r}: {exc}", "messages" if req.endpoint is Endpoint.CHAT else "prompt") from None

    def _tokenizer(self, model: str, endpoints: Sequence[WorkerEndpoint]) -> PromptTokenizer | None:
        found = self.tokenizers.get(model)
        if found is None:  # a LoRA adapter tokenizes as its base model
            for ep in endpoints:
                if model in ep.loras and ep.models:
                    return self.tokenizers.get(ep.models[0])
        return found

    async def _engine_ids(self, req: OpenAIRequest, ep: WorkerEndpoint, upstream: UpstreamPool) -> np.ndarray:
        body: dict[str, Any] = {"model": req.model}
        if req.endpoint is Endpoint.CHAT:
            body |= {k: req.body[k] for k in _CHAT_FIELDS if k in req.body}
        else:
            prompt = req.body["prompt"]
            body["prompt"] = prompt if isinstance(prompt, str) else prompt[0]
        headers = [_JSON, (b"authorization", b"Bearer " + ep.api_key.encode())] if ep.api_key else [_JSON]
        resp = None
        try:
            resp = await upstream.request(ep.url, b"POST", b"/tokenize", headers, orjson.dumps(body))
            answer = await resp.read()
        except UpstreamError as exc:
            raise _EngineDown(upstream_failed(502, f"worker {ep.worker_id}'s /tokenize failed: {type(exc).__name__}: {exc}")) from None
        finally:
            if resp is not None:
                resp.close()
        if resp.status >= 500:
            raise _EngineDown(upstream_failed(502, f"worker {ep.worker_id}'s /tokenize answered {resp.status}: {answer[:300]!r}"))
        if resp.status != 200:  # the engine refuses this prompt: no other would take it
            raise upstream_failed(resp.status, f"worker {ep.worker_id}'s /tokenize answered {resp.status}: {answer[:300]!r}")
        try:
            packed = _native.tokenize_answer_ids(answer)
        except ValueError as exc:  # not JSON, no "tokens", or an id outside [0, 2**32)
            raise upstream_failed(
                502, f"worker {ep.worker_id}'s /tokenize gave no token ids ({exc}): {answer[:300]!r}"
            ) from None
        return np.frombuffer(packed, dtype=np.uint32)
