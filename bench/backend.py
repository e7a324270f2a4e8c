"""A fast OpenAI-compatible backend for ``kvstream bench gateway``: what every front (the
gateway, the peer routers, nothing) is measured in front of.

An HTTP/1.1 server on raw asyncio (uvloop when installed), so that the backend is not the
limit of the bench: each answer is built from bytes prepared once per request. It speaks
vLLM's shapes: ``/v1/completions`` and ``/v1/chat/completions`` (a JSON answer, or SSE
with one event per token and ``data: [DONE]``; ``usage`` at the end of a stream when
``stream_options.include_usage``), ``/tokenize``, ``/v1/completions/render`` and
``/v1/chat/completions/render`` (the token ids vllm-router asks for), ``/health``,
``/v1/models``, and ``/metrics`` (requests served, by path). Tokens are the prompt's
UTF-8 bytes (a chat renders as ``role: content`` lines); every output token is the same
placeholder. The answer's ``id`` names the backend's port and a request counter, so a
client can tell which backend answered. Bad input gets vLLM's 4xx error body.

Run as ``python -m bench.backend --port P``, one process per backend
(:func:`start_backends`).
"""

from __future__ import annotations

import asyncio
import itertools
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, cast

import click
import orjson

from kvstream.tools.procs import ManagedProcess, free_port, wait_http

#: The model name the backend serves.
MODEL = "kvstream-bench"
#: Output tokens of a request that names no ``max_tokens``.
DEFAULT_TOKENS = 256
#: Most output tokens one request may ask for (bounds the work of one request).
MAX_OUTPUT_TOKENS = 1 << 16
MAX_MODEL_LEN = 1 << 20
#: Largest request body read (bytes).
MAX_BODY = 64 << 20
_TOKEN_TEXT = " a"
_PATHS = frozenset({
    "/health", "/v1/models", "/metrics", "/v1/completions", "/v1/chat/completions", "/tokenize",
    "/v1/completions/render", "/v1/chat/completions/render",
})


@dataclass(frozen=True, slots=True)
class BackendOptions:
    port: int
    host: str = "127.0.0.1"
    model: str = MODEL
    default_tokens: int = DEFAULT_TOKENS


class BadRequest(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


_REASONS = {200: b"OK", 400: b"Bad Request", 404: b"Not Found", 405: b"Method Not Allowed",
            411: b"Length Required", 413: b"Payload Too Large", 501: b"Not Implemented"}


def _error_body(status: int, message: str) -> bytes:
    # vLLM's ErrorResponse.
    kind = "NotFoundError" if status == 404 else "BadRequestError"
    return orjson.dumps({"error": {"message": message, "type": kind, "param": None, "code": status}})


def _head(status: int, ctype: bytes, length: int | None, close: bool) -> bytes:
    size = b"Transfer-Encoding: chunked\r\n" if length is None else b"Content-Length: %d\r\n" % length
    conn = b"Connection: close\r\n" if close else b""
    return b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\n%s%s\r\n" % (status, _REASONS.get(status, b"OK"), ctype, size, conn)


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _text_of(content: Any) -> str:
    """A chat message's text: a string, or the text parts of a list of parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    raise BadRequest(400, "`content` must be a string or a list of parts")


class Engine:
    """The answers; one per backend process."""

    def __init__(self, options: BackendOptions) -> None:
        self.options = options
        self.served: Counter[str] = Counter()
        self._ids = itertools.count()
        self._models = orjson.dumps({"object": "list", "data": [{
            "id": options.model, "object": "model", "created": int(time.time()), "owned_by": "vllm",
            "root": options.model, "parent": None, "max_model_len": MAX_MODEL_LEN, "permission": [],
        }]})

    # -- tokens ---------------------------------------------------------------------------

    def prompt_ids(self, body: dict[str, Any], chat: bool) -> list[int]:
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise BadRequest(400, "`messages` must be a non-empty list")
            if not all(isinstance(m, dict) for m in messages):
                raise BadRequest(400, "each message must be an object")
            text = "".join(f"{m.get('role', '')}: {_text_of(m.get('content'))}\n" for m in messages) + "assistant: "
            return list(text.encode())
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            return list(prompt.encode())
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and t >= 0 for t in prompt):
            return prompt
        raise BadRequest(400, "`prompt` must be a string or a non-empty list of token ids")

    def output_tokens(self, body: dict[str, Any]) -> int:
        n = body.get("max_completion_tokens", body.get("max_tokens"))
        if n is None:
            return self.options.default_tokens
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_OUTPUT_TOKENS:
            raise BadRequest(400, f"`max_tokens` must be an integer in [1, {MAX_OUTPUT_TOKENS}]")
        return n

    def _model(self, body: dict[str, Any]) -> str:
        model = body.get("model", self.options.model)
        if model != self.options.model:
            raise BadRequest(404, f"The model `{model}` does not exist.")
        return model

    # -- dispatch -------------------------------------------------------------------------

    def handle(self, method: bytes, path: str, raw: bytes) -> tuple[int, bytes, list[bytes] | bytes]:
        """(status, content type, body): bytes for a whole answer, a list of SSE events
        for a stream."""
        # Unknown paths share one counter (a client must not grow the table at will).
        self.served[path if path in _PATHS else "other"] += 1
        if method == b"GET":
            if path == "/health":
                return 200, b"application/json", b""
            if path == "/v1/models":
                return 200, b"application/json", self._models
            if path == "/metrics":
                lines = [f'kvstream_bench_backend_requests_total{{path="{p}"}} {n}' for p, n in sorted(self.served.items())]
                return 200, b"text/plain; version=0.0.4", ("\n".join(lines) + "\n").encode()
        routes = {
            "/v1/completions": self.completion, "/v1/chat/completions": self.completion,
            "/tokenize": self.tokenize, "/v1/completions/render": self.render,
            "/v1/chat/completions/render": self.render,
        }
        if path not in routes:
            raise BadRequest(404, f"no route {path}")
        if method != b"POST":
            raise BadRequest(405, f"{path} takes POST")
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise BadRequest(400, f"the body is not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise BadRequest(400, "the body must be a JSON object")
        return routes[path](path, body)

    def tokenize(self, _path: str, body: dict[str, Any]) -> tuple[int, bytes, bytes]:
        ids = self.prompt_ids(body, chat="messages" in body)
        return 200, b"application/json", orjson.dumps(
            {"count": len(ids), "max_model_len": MAX_MODEL_LEN, "tokens": ids, "token_strs": None}
        )

    def render(self, path: str, body: dict[str, Any]) -> tuple[int, bytes, bytes]:
        chat = path.startswith("/v1/chat/")
        ids = self.prompt_ids(body, chat)
        out = {
            "request_id": f"render-{self.options.port}-{next(self._ids)}", "token_ids": ids,
            "sampling_params": {"max_tokens": self.output_tokens(body)}, "model": self._model(body),
            "stream": bool(body.get("stream", False)),
        }
        # vLLM answers a completion render with one generate request per prompt.
        return 200, b"application/json", orjson.dumps(out if chat else [out])

    def completion(self, path: str, body: dict[str, Any]) -> tuple[int, bytes, list[bytes] | bytes]:
        chat = path == "/v1/chat/completions"
        model = self._model(body)
        prompt = len(self.prompt_ids(body, chat))
        n = self.output_tokens(body)
        usage = {"prompt_tokens": prompt, "total_tokens": prompt + n, "completion_tokens": n,
                 "prompt_tokens_details": None}
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{self.options.port}-{next(self._ids)}"
        head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": model}
        if not body.get("stream"):
            if chat:
                message = {"role": "assistant", "content": _TOKEN_TEXT * n, "refusal": None, "annotations": None,
                           "audio": None, "function_call": None, "tool_calls": [], "reasoning_content": None}
                choice: dict[str, Any] = {"index": 0, "message": message, "logprobs": None,
                                          "finish_reason": "length", "stop_reason": None}
            else:
                choice = {"index": 0, "text": _TOKEN_TEXT * n, "logprobs": None, "finish_reason": "length",
                          "stop_reason": None, "prompt_logprobs": None}
            obj = {**head, "object": "chat.completion" if chat else "text_completion", "choices": [choice],
                   "usage": usage, "kv_transfer_params": None}
            return 200, b"application/json", orjson.dumps(obj)

        def event(choice: dict[str, Any] | None, extra: dict[str, Any] | None = None) -> bytes:
            return b"data: " + orjson.dumps({**head, "choices": [choice] if choice else [], **(extra or {})}) + b"\n\n"

        def token(finish: str | None, first: bool = False) -> bytes:
            if chat:
                delta = {"role": "assistant", "content": _TOKEN_TEXT} if first else {"content": _TOKEN_TEXT}
                return event({"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish, "stop_reason": None})
            return event({"index": 0, "text": _TOKEN_TEXT, "logprobs": None, "finish_reason": finish, "stop_reason": None})

        middle = token(None)
        events = [token("length" if n == 1 else None, first=True), *([middle] * max(0, n - 2))]
        if n > 1:
            events.append(token("length"))
        options = body.get("stream_options") or {}
        if isinstance(options, dict) and options.get("include_usage"):
            events.append(event(None, {"usage": usage}))
        events.append(b"data: [DONE]\n\n")
        return 200, b"text/event-stream", events


class _Connection(asyncio.Protocol):
    """One keep-alive connection: requests are answered in order as they complete."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while self.transport is not None and not self.transport.is_closing():
            try:
                request = self._take()
            except BadRequest as exc:
                self._answer(exc.status, b"application/json", _error_body(exc.status, str(exc)), close=True)
                return
            if request is None:
                return
            method, path, body, close = request
            try:
                status, ctype, out = self.engine.handle(method, path, body)
            except BadRequest as exc:
                status, ctype, out = exc.status, b"application/json", _error_body(exc.status, str(exc))
            self._answer(status, ctype, out, close)

    def _take(self) -> tuple[bytes, str, bytes, bool] | None:
        """The next whole request in the buffer (removed from it), or None."""
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            if len(self.buf) > 1 << 16:
                raise BadRequest(400, "request headers too large")
            return None
        lines = bytes(self.buf[:end]).split(b"\r\n")
        try:
            method, target, version = lines[0].split(b" ")
        except ValueError:
            raise BadRequest(400, "malformed request line") from None
        headers = {}
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep:
                raise BadRequest(400, "malformed header line")
            headers[name.strip().lower()] = value.strip()
        start = end + 4
        if headers.get(b"transfer-encoding", b"").lower() == b"chunked":
            body, size = self._dechunk(start)
            if body is None:
                return None
        else:
            try:
                length = int(headers.get(b"content-length", b"0"))
            except ValueError:
                raise BadRequest(400, "bad Content-Length") from None
            if not 0 <= length <= MAX_BODY:
                raise BadRequest(413, f"bodies are limited to {MAX_BODY} bytes")
            if len(self.buf) < start + length:
                return None
            body, size = bytes(self.buf[start:start + length]), start + length
        del self.buf[:size]
        connection = headers.get(b"connection", b"").lower()
        close = connection == b"close" or (version == b"HTTP/1.0" and connection != b"keep-alive")
        return method, target.split(b"?", 1)[0].decode("latin-1"), body, close

    def _dechunk(self, pos: int) -> tuple[bytes | None, int]:
        parts = []
        while True:
            eol = self.buf.find(b"\r\n", pos)
            if eol < 0:
                return None, 0
            try:
                size = int(bytes(self.buf[pos:eol]).split(b";", 1)[0], 16)
            except ValueError:
                raise BadRequest(400, "bad chunk size") from None
            if size == 0:
                trailer = self.buf.find(b"\r\n\r\n", eol)
                if trailer < 0:
                    return None, 0
                return b"".join(parts), trailer + 4
            if len(self.buf) < eol + 2 + size + 2:
                return None, 0
            parts.append(bytes(self.buf[eol + 2:eol + 2 + size]))
            if sum(map(len, parts)) > MAX_BODY:
                raise BadRequest(413, f"bodies are limited to {MAX_BODY} bytes")
            pos = eol + 2 + size + 2

    def _answer(self, status: int, ctype: bytes, out: list[bytes] | bytes, close: bool) -> None:
        assert self.transport is not None
        if isinstance(out, bytes):
            self.transport.write(_head(status, ctype, len(out), close) + out)
        else:
            # One HTTP chunk per SSE event, as an engine writes them.
            self.transport.write(b"".join([_head(status, ctype, None, close), *map(_chunk, out), b"0\r\n\r\n"]))
        if close:
            self.transport.close()


async def serve(options: BackendOptions) -> None:
    engine = Engine(options)
    loop = asyncio.get_running_loop()
    # No SO_REUSEADDR games: a port that is taken is refused (bind fails).
    server = await loop.create_server(lambda: _Connection(engine), options.host, options.port, reuse_address=False)
    async with server:
        await server.serve_forever()


def _run(options: BackendOptions) -> None:
    try:
        import uvloop
    except ImportError:  # plain asyncio is slower, not different
        asyncio.run(serve(options))
    else:
        uvloop.run(serve(options))


@contextmanager
def start_backends(count: int, tokens: int = DEFAULT_TOKENS, ready_timeout: float = 30.0) -> Iterator[list[ManagedProcess]]:
    """``count`` backend processes on free loopback ports, each ready (``.url``: the base
    URL, no ``/v1``). They stop when the block ends."""
    procs: list[ManagedProcess] = []
    try:
        for _ in range(count):
            port = free_port()
            cmd = [sys.executable, "-m", "bench.backend", "--port", str(port), "--tokens", str(tokens)]
            proc = ManagedProcess.start(f"backend:{port}", cmd, port)
            procs.append(proc)
        for proc in procs:
            wait_http(proc, "/health", ready_timeout)
        yield procs
    finally:
        for proc in procs:
            proc.stop()


def backend_requests(url: str, path: str, client: Any) -> int:
    """How many requests for ``path`` the backend at ``url`` has served (its /metrics)."""
    text = client.get(url + "/metrics").text
    key = f'kvstream_bench_backend_requests_total{{path="{path}"}} '
    return next((int(line.removeprefix(key)) for line in text.splitlines() if line.startswith(key)), 0)


@click.command()
@click.option("--port", type=int, required=True, help="Loopback port to listen on (refused if taken).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option("--model", default=MODEL, show_default=True, help="The model name served.")
@click.option("--tokens", type=int, default=DEFAULT_TOKENS, show_default=True,
              help="Output tokens of a request without max_tokens.")
def main(port: int, host: str, model: str, tokens: int) -> None:
    """A fast OpenAI-compatible backend (vLLM's shapes) for kvstream bench gateway."""
    _run(BackendOptions(port=port, host=host, model=model, default_tokens=tokens))


if __name__ == "__main__":
    main()
