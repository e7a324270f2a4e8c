"""Load ops handed to the producer at once when they are sparse, a window's worth
together when they are dense.

A peer routes on the ops it has heard: an op held back is a route the peers cannot see,
and at N replicas the requests of a burst reaching several replicas then crowd onto one
worker. A fixed linger held every op 10 ms; no linger at all made a busy gateway's Kafka
client send a produce request per op or two (its CPU per request +35 %). So an op that
comes a window or more after the last hand-off goes at once; one that comes sooner waits
for that window's end, and everything that came meanwhile goes with it. Ops are handed
over in the order they came (a peer sees a request's ops in order).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

from kvstream.logs import get_logger

log = get_logger(__name__)
T = TypeVar("T")


class Pacer(Generic[T]):
    """Items passed to ``send`` in order: at once, or in lists of a window's items (at
    most one hand-off per ``window_s`` while items keep coming)."""

    def __init__(self, send: Callable[[list[T]], None], name: str, window_s: float) -> None:
        self._send, self._window = send, window_s
        self._cond = threading.Condition()
        self._waiting: list[T] = []
        self._last = -window_s  # monotonic time of the last hand-off
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, item: T) -> None:
        with self._cond:
            now = time.monotonic()
            if self._closed or not self._waiting and now - self._last >= self._window:
                self._last = now
                self._send([item])  # under the lock: nothing waiting can be overtaken
                return
            self._waiting.append(item)
            if len(self._waiting) == 1:
                self._cond.notify()

    def close(self) -> None:
        """Hand over what waits now; later items go at once."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()

    def _run(self) -> None:
        with self._cond:
            while True:
                if not self._waiting:
                    if self._closed:
                        return
                    self._cond.wait()
                    continue
                left = self._last + self._window - time.monotonic()
                if left > 0 and not self._closed:
                    self._cond.wait(left)
                    continue
                items, self._waiting = self._waiting, []
                self._last = time.monotonic()
                try:
                    self._send(items)
                except Exception as exc:  # noqa: BLE001 - the thread must live: later ops would wait for ever
                    log.error("load ops not handed to the producer", ops=len(items), error=f"{type(exc).__name__}: {exc}")
