"""Errors of the event vocabulary and its wire codec."""


class EventError(ValueError):
    """An event that violates the event model (bad tier, medium, hash range...)."""


class UnknownMediumError(EventError):
    """An engine ``medium`` string that maps to no storage tier."""


class DecodeError(EventError):
    """Bytes that cannot be decoded into events; the message says why."""
