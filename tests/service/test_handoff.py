"""LoopHandoff: callbacks cross from other threads in order, one loop wake-up per flush."""

from __future__ import annotations

import asyncio
import threading

from service.handoff import LoopHandoff


def test_a_batch_crosses_in_order_with_one_wake_up_and_survives_a_failing_callback():
    loop = asyncio.new_event_loop()
    wakes = []
    real = loop.call_soon_threadsafe
    loop.call_soon_threadsafe = lambda *a: (wakes.append(a), real(*a))[1]
    errors = []
    loop.set_exception_handler(lambda _loop, ctx: errors.append(ctx["exception"]))
    handoff, got = LoopHandoff(loop), []

    def boom(_):
        raise ValueError("consumer broke")

    def step():                                      # what the scheduler thread does per step
        for i in range(32):
            handoff.call(boom if i == 5 else got.append, i)
        handoff.flush()
        handoff.flush()                              # a drain is already on its way: no-op

    try:
        sender = threading.Thread(target=step)
        sender.start()
        sender.join()
        assert len(wakes) == 1 and got == []         # queued, loop woken once, nothing run yet
        loop.run_until_complete(asyncio.sleep(0))
        assert got == [i for i in range(32) if i != 5]
        assert [str(e) for e in errors] == ["consumer broke"]
        handoff.flush()                              # nothing queued: no wake-up
        assert len(wakes) == 1
        handoff.call(got.append, 99)
        loop.run_until_complete(asyncio.sleep(0))
        assert 99 not in got                         # not run before its flush
        handoff.flush()
        loop.run_until_complete(asyncio.sleep(0))
        assert got[-1] == 99 and got.count(99) == 1 and len(wakes) == 2
    finally:
        loop.close()
