"""LoopHandoff: callbacks cross from other threads in order, one loop wake-up per batch."""

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

    try:
        sender = threading.Thread(target=lambda: [handoff.call(got.append, i) if i != 5
                                                  else handoff.call(boom, i) for i in range(32)])
        sender.start()
        sender.join()
        assert len(wakes) == 1                       # the loop was not running: one drain queued
        loop.run_until_complete(asyncio.sleep(0))
        assert got == [i for i in range(32) if i != 5]
        assert [str(e) for e in errors] == ["consumer broke"]
        handoff.call(got.append, 99)                 # after a drain, the next call wakes again
        loop.run_until_complete(asyncio.sleep(0))
        assert got[-1] == 99 and len(wakes) == 2
    finally:
        loop.close()
