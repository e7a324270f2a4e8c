"""kvstream.replica.loop_lock: an op from the event loop runs there while the replica's
lock is free or held briefly, and in a thread while it is held long."""

from __future__ import annotations

import asyncio
import threading

from kvstream.replica.loop_lock import LoopLock


def _holder(lock: threading.RLock, hold_s: float) -> tuple[threading.Thread, threading.Event]:
    taken = threading.Event()

    def hold() -> None:
        with lock:
            taken.set()
            threading.Event().wait(hold_s)

    t = threading.Thread(target=hold)
    t.start()
    taken.wait()
    return t, taken


def test_a_brief_hold_is_waited_out_on_the_loop() -> None:
    """The case that cascaded: the lock held for a moment by another thread. Before, the
    op went to a thread; now the loop waits for it (the wait is long here so that a slow
    machine cannot make the hold the longer)."""
    lock = threading.RLock()
    loop_lock = LoopLock(lock, wait_s=5.0)

    def op() -> int:
        with lock:
            return threading.get_ident()

    async def main() -> None:
        holder, _ = _holder(lock, 0.05)
        assert await loop_lock.run(op) == threading.get_ident()
        holder.join()
        assert await loop_lock.run(op) == threading.get_ident()  # free: inline

    asyncio.run(main())


def test_a_long_hold_sends_ops_to_threads_until_the_lock_is_free() -> None:
    lock = threading.RLock()
    loop_lock = LoopLock(lock, wait_s=0.01)
    ran_in: list[int] = []

    def op() -> None:
        with lock:
            ran_in.append(threading.get_ident())

    async def main() -> None:
        holder, _ = _holder(lock, 0.5)
        await asyncio.gather(loop_lock.run(op), loop_lock.run(op))
        holder.join()
        me = threading.get_ident()
        assert len(ran_in) == 2 and me not in ran_in, "both waited in threads"
        await loop_lock.run(op)
        assert ran_in[-1] == me, "once the lock is free, inline again"

    asyncio.run(main())


def test_inline_false_always_goes_to_a_thread() -> None:
    lock = threading.RLock()
    loop_lock = LoopLock(lock)

    def op() -> tuple[int, bool]:
        with lock:
            return threading.get_ident(), True

    async def main() -> None:
        ident, _ = await loop_lock.run(op, inline=False)
        assert ident != threading.get_ident()

    asyncio.run(main())
