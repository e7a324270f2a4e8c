"""Errors of the replica: snapshots, recovery, the consume loop."""


class ReplicaError(Exception):
    """Base of every replica error."""


class SnapshotError(ReplicaError):
    """A snapshot that cannot be read or trusted; the message says why."""


class RecoveryError(ReplicaError):
    """The replica cannot start from what it has (no usable snapshot, topic missing)."""


class AmbiguousRequestError(ReplicaError):
    """A prefill_done or free of a client id that several other replicas have active."""
