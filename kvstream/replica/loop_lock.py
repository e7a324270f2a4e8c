"""Work under the replica's lock from the event loop: the gateway's routes and load ops,
and ``POST /v1/route``.

Inline while the lock is free or held briefly; in a thread while it is held long. A
thread that holds the lock for a moment (a fold slice, ~1 ms: FOLD_HOLD_S; a routing
thread) may be waiting for the GIL the loop holds: the loop waits for the lock with the
GIL released, a few ms at most, and the holder finishes. Sending each such op to a thread
instead cascaded: the op's thread, holding the lock, waited a GIL switch interval for
the loop, and every op meanwhile went to a thread too (~2 % of a busy gateway's ops,
in bursts of hundreds). A hold longer than the wait (a snapshot's partition captured)
sends the ops to threads at once until the loop sees the lock free again.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import anyio

T = TypeVar("T")

#: How long the event loop waits for a held lock before the op goes to a thread:
#: past one fold slice's hold (kvstream.replica.fold.FOLD_HOLD_S, 1 ms).
LOOP_WAIT_S = 0.002


class LoopLock:
    """The replica's lock, as the event loop takes it."""

    __slots__ = ("_held_long", "_lock", "_wait_s")

    def __init__(self, lock: threading.RLock, wait_s: float = LOOP_WAIT_S) -> None:
        self._lock, self._wait_s = lock, wait_s
        #: The last wait timed out: ops go to threads until the lock is seen free.
        self._held_long = False

    async def run(self, fn: Callable[..., T], *args: object, inline: bool = True,
                  limiter: anyio.CapacityLimiter | None = None) -> T:
        """``fn(*args)``: on the loop with the lock held (``inline``, and the lock free
        or held briefly), else in a thread of ``limiter``; ``fn`` takes the lock itself
        (it is re-entrant), so that in a thread it waits there."""
        if inline and self._take():
            try:
                return fn(*args)
            finally:
                self._lock.release()
        return await anyio.to_thread.run_sync(lambda: fn(*args), limiter=limiter)

    def _take(self) -> bool:
        if self._lock.acquire(blocking=False):
            self._held_long = False
            return True
        if self._held_long:
            return False
        if self._lock.acquire(timeout=self._wait_s):
            return True
        self._held_long = True
        return False
