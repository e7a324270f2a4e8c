"""Errors of ``kvstream simulate``: each is printed as one clear message (exit code 2)."""

from kvstream.engine_model.errors import EngineModelError

#: A simulation that cannot run as asked; the message says why. It is the engine model's
#: error, so that the cost model shared with ``kvstream emulate`` raises it too.
SimulationError = EngineModelError


class TraceError(SimulationError):
    """A trace file that cannot be read (the message names the file and line)."""


class EventLogError(SimulationError):
    """The event log could not publish or fold the events in time."""
