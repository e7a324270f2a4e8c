"""kvstream.replica.pacer: sparse load ops go at once, dense ones a window's worth
together, always in the order they came, none lost at close."""

from __future__ import annotations

import threading
import time

from kvstream.replica.pacer import Pacer


class Sent:
    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.at: list[float] = []
        self.lock = threading.Lock()

    def __call__(self, items: list[int]) -> None:
        with self.lock:
            self.batches.append(list(items))
            self.at.append(time.monotonic())


def test_a_sparse_op_goes_at_once_and_ops_within_a_window_go_together_at_its_end() -> None:
    sent = Sent()
    pacer = Pacer(sent, "test-pacer", window_s=0.3)
    t0 = time.monotonic()
    pacer.put(1)
    assert sent.batches == [[1]]  # handed over by put itself
    pacer.put(2)
    pacer.put(3)
    assert sent.batches == [[1]]  # within the window of the first: they wait
    deadline = time.monotonic() + 5
    while len(sent.batches) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sent.batches == [[1], [2, 3]]
    assert sent.at[1] - t0 >= 0.3  # not before the window's end
    time.sleep(0.35)
    pacer.put(4)  # a window after the last hand-off: at once again
    assert sent.batches[-1] == [4]
    pacer.close()


def test_close_hands_over_what_waits_and_later_ops_go_at_once() -> None:
    sent = Sent()
    pacer = Pacer(sent, "test-pacer", window_s=60)
    for i in range(5):
        pacer.put(i)
    assert sent.batches == [[0]]
    pacer.close()
    assert sent.batches == [[0], [1, 2, 3, 4]]
    pacer.put(5)
    assert sent.batches[-1] == [5]


def test_ops_from_many_threads_keep_each_threads_order_and_none_is_lost() -> None:
    sent = Sent()
    pacer = Pacer(sent, "test-pacer", window_s=0.002)
    n, per = 4, 3000

    def put(t: int) -> None:
        for i in range(per):
            pacer.put(t * per + i)
            if i % 100 == 0:
                time.sleep(0.003)  # sparse now and then: some go at once

    threads = [threading.Thread(target=put, args=(t,)) for t in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    pacer.close()
    flat = [x for batch in sent.batches for x in batch]
    assert sorted(flat) == list(range(n * per))
    for t in range(n):
        mine = [x for x in flat if x // per == t]
        assert mine == sorted(mine)
    assert 1 < len(sent.batches) < n * per  # some batched, some alone


def test_a_failing_hand_off_is_logged_and_the_next_ops_still_go() -> None:
    sent = Sent()
    failed = threading.Event()

    def send(items: list[int]) -> None:
        if items == [1, 2]:
            failed.set()
            raise RuntimeError("producer gone")
        sent(items)

    pacer = Pacer(send, "test-pacer", window_s=0.05)
    pacer.put(0)
    pacer.put(1)
    pacer.put(2)
    assert failed.wait(5)
    time.sleep(0.06)
    pacer.put(3)  # the thread lives on: it goes at once
    pacer.close()
    assert sent.batches == [[0], [3]]
