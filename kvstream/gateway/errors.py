"""Errors of the gateway (tokenization, options, upstream workers) and their OpenAI
form: every refusal on an OpenAI endpoint is ``{"error": {"message", "type", "param",
"code"}}`` with the status OpenAI uses."""

from __future__ import annotations

import orjson


class GatewayError(Exception):
    """Base of every gateway error."""


class TokenizerConfigError(GatewayError, ValueError):
    """A model's tokenizer that cannot be loaded (missing file, bad JSON, bad template)."""


class TokenizeError(GatewayError, ValueError):
    """A prompt that cannot be turned into token ids (bad ids, template error, engine
    failure); the message is fit for the client (an OpenAI ``invalid_request_error``)."""


class OptionsError(GatewayError, ValueError):
    """Gateway options or static workers that cannot be used; the message says why."""


class UpstreamError(GatewayError):
    """A worker that could not be asked or did not answer in full (kvstream.gateway.upstream);
    the message says what happened."""


class UpstreamConnectError(UpstreamError):
    """No connection to the worker (refused, unreachable, TLS failed, or none within the
    connect timeout): the request never left."""


class UpstreamTimeout(UpstreamError):
    """The worker sent nothing for the read timeout."""


class UpstreamBroken(UpstreamError):
    """The worker's connection closed, or it sent what is not HTTP/1.1, before its answer
    was whole."""


class ApiError(GatewayError):
    """A request the gateway answers with an error: status, OpenAI error fields, and
    the headers that go with it (``Retry-After``)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.retry_after_s = retry_after_s

    def body(self) -> bytes:
        return orjson.dumps({"error": self.fields()})

    def fields(self) -> dict[str, str | None]:
        return {"message": self.message, "type": self.type, "param": self.param, "code": self.code}

    def headers(self) -> dict[str, str]:
        return {} if self.retry_after_s is None else {"retry-after": str(self.retry_after_s)}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def unauthorized(message: str) -> ApiError:
    return ApiError(401, message, code="invalid_api_key")


def unknown_model(model: str) -> ApiError:
    return ApiError(404, f"the model {model!r} does not exist (no registered worker serves it)",
                    param="model", code="model_not_found")


def overloaded(message: str, retry_after_s: int) -> ApiError:
    return ApiError(429, message, type="rate_limit_error", code="overloaded", retry_after_s=retry_after_s)


def unavailable(message: str, retry_after_s: int) -> ApiError:
    return ApiError(503, message, type="service_unavailable", code="no_worker_available", retry_after_s=retry_after_s)


def upstream_failed(status: int, message: str) -> ApiError:
    return ApiError(status, message, type="upstream_error", code="upstream_failed")
