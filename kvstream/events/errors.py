"""Errors of the event vocabulary and its wire codec."""


class EventError(ValueError):
    """An event that violates the event model (bad tier, medium, hash range...)."""


class UnknownMediumError(EventError):
    """An engine ``medium`` string that maps to no storage tier."""


class EncodeError(EventError):
    """A record or event that cannot be encoded (value out of range, wrong type...)."""


class DecodeError(EventError):
    """Bytes that cannot be decoded into events; the message says why.

    ``reason`` is a short fixed code (one of ``REASONS``) for counting and for the DLQ
    headers; the message carries the details.
    """

    REASONS = frozenset({"truncated", "marker", "fingerprint", "malformed", "invalid", "type"})

    def __init__(self, message: str, *, reason: str = "malformed") -> None:
        if reason not in self.REASONS:
            raise ValueError(f"unknown decode error reason {reason!r}")
        super().__init__(message)
        self.reason = reason


class SchemaError(ValueError):
    """A schema directory or file that cannot be loaded; the message names the file."""
