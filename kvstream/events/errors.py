"""Errors of the records every package shares (router events, worker registrations) and
their wire codec."""


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


class RegistrationError(EventError):
    """A worker registration (kvstream.events.registration) that cannot be built, encoded or
    applied; the message says why. ``reason`` is a short fixed code for counting
    (``kvstream_registry_skipped``)."""

    def __init__(self, message: str, *, reason: str = "invalid") -> None:
        super().__init__(message)
        self.reason = reason


class SchemaError(ValueError):
    """A schema directory or file that cannot be loaded; the message names the file."""
