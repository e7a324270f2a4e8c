"""Errors of ``kvstream simulate``: each is printed as one clear message (exit code 2)."""


class SimulationError(Exception):
    """A simulation that cannot run as asked; the message says why."""


class TraceError(SimulationError):
    """A trace file that cannot be read (the message names the file and line)."""


class EventLogError(SimulationError):
    """The event log could not publish or fold the events in time."""
