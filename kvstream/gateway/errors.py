"""Errors of the gateway: worker registrations and prompt tokenization."""


class GatewayError(Exception):
    """Base of every gateway error."""


class RegistrationError(GatewayError, ValueError):
    """A worker registration that cannot be built, encoded or applied; the message says
    why. ``reason`` is a short fixed code for counting (``kvstream_registry_skipped``)."""

    def __init__(self, message: str, *, reason: str = "invalid") -> None:
        super().__init__(message)
        self.reason = reason


class TokenizerConfigError(GatewayError, ValueError):
    """A model's tokenizer that cannot be loaded (missing file, bad JSON, bad template)."""


class TokenizeError(GatewayError, ValueError):
    """A prompt that cannot be turned into token ids (bad ids, template error, engine
    failure); the message is fit for the client (an OpenAI ``invalid_request_error``)."""
