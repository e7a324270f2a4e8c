"""Errors of the router core (tier indexes, scheduler, active sequences, Router)."""


class RouterError(Exception):
    """Base of every router error."""


class SchedulerConfigError(RouterError, ValueError):
    """A scheduler weight, threshold or override that is out of range."""


class NoEligibleWorkerError(RouterError):
    """No candidate may take the request; the message says why (none known, none
    allowed, all busy)."""


class UnknownRequestError(RouterError, KeyError):
    """prefill_done / free of a request that is not active (never added, freed or
    expired)."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class DuplicateRequestError(RouterError, ValueError):
    """A request id that is already active was added again."""


class UnknownWorkerError(RouterError, KeyError):
    """An operation names a worker the router does not know."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""
