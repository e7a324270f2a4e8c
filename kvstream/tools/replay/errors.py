"""Errors of ``kvstream replay``: each one is printed as one clear message (no traceback)
and ends the command with exit code 2 (1 is kept for ``replay diff``: "they differ")."""


class ReplayError(Exception):
    """A replay that cannot be done; the message says why."""


class TopicMissingError(ReplayError):
    """The topic to read does not exist."""


class RetentionError(ReplayError):
    """The asked range starts before what retention kept, so the answer would be wrong."""


class SourceError(ReplayError):
    """A snapshot, replica or time given to compare or restore from cannot be used."""
