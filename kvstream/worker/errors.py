"""Errors of the worker side (tiered pool, offload, onboarding, consolidator, publisher)."""


class LayoutError(ValueError):
    """A block or KV tensor whose shape, dtype or device does not fit the pool's layout."""


class PoolConfigError(ValueError):
    """Pool or offload options that cannot work (zero capacity, bad sizes...)."""


class DiskTierError(OSError):
    """The G3 block file cannot be created, sized, written or read; says which and why."""


class PoolExhaustedError(RuntimeError):
    """A tier has too few free or evictable blocks for an allocation (the rest are pinned)."""


class UnknownBlockError(LookupError):
    """A block hash or slot that the tier does not hold in the required state."""


class BlockPinnedError(RuntimeError):
    """An operation that needs an unpinned block (explicit removal) met a pinned one."""


class OffloadClosedError(RuntimeError):
    """The offload engine was closed; it accepts no more work."""


class PublisherError(RuntimeError):
    """The publisher cannot put events on Kafka as asked; the message says why."""


class PublisherQueueFullError(PublisherError):
    """The producer's bounded queue stayed full (policy ``fail``, or ``block`` past its
    timeout); the batch was not published and the next poll resyncs."""


class PublisherClosedError(PublisherError):
    """Events given to a publisher that was closed or hit a fatal producer error."""


class ControlTopicError(PublisherError):
    """The control topic (resync requests) cannot be read or written."""


class EngineBridgeError(RuntimeError):
    """An engine bridge that cannot start (bad endpoint, unsupported engine)."""


class BridgeStateError(RuntimeError):
    """The bridge's saved state cannot be used (another worker's, unreadable, locked)."""


class RegistryTopicError(PublisherError):
    """The worker's registration cannot be put on the workers topic (missing, refused)."""
