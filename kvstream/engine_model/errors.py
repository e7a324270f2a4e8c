"""Errors of the engine model (kvstream.engine_model)."""


class EngineModelError(Exception):
    """Engine-model settings that cannot work (a negative cost, a budget below the batch
    limit); the message says which and why. ``kvstream simulate`` reports its own
    failures with this class too (its ``SimulationError``)."""
