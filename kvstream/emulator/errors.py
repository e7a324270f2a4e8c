"""Errors of the emulated engine (kvstream.emulator)."""

from __future__ import annotations

from kvstream.engine_model.errors import EngineModelError


class EmulatorConfigError(EngineModelError):
    """Emulator options that cannot work (a model length the cache cannot hold, a bad
    endpoint, an unreadable tokenizer); the message says which and why."""


class RequestError(ValueError):
    """A request the engine refuses, answered as vLLM answers it: an OpenAI error body
    with ``type``, ``param`` and the HTTP status as ``code``."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400,
                 err_type: str = "BadRequestError") -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.err_type = err_type

    def body(self) -> dict[str, object]:
        return {"error": {"message": self.message, "type": self.err_type, "param": self.param, "code": self.status}}
