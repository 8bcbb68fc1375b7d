"""Callbacks from the engine's scheduler thread onto the service's event loop, woken once per step.

`loop.call_soon_threadsafe` writes a byte to the loop's self-pipe on every call; a 32-row decode
step pushes 32 token events, so per-event calls cost 32 system calls and as many loop wake-ups a
step, on the scheduler thread that should be running the next step (≈ 7 % of its time in a live
run of 32 streams, measured with py-spy). Waking the loop at the first event of a step was not
enough: the woken loop then took the GIL from the scheduler thread while it pushed the other 31
(≈ 4 % of that thread's samples, blocked in the wake-up's write). So `LoopHandoff.call` only
queues, and `flush` — called once after the step's events are pushed — wakes the loop once.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable


class LoopHandoff:
    """Runs callbacks on `loop` in the order `call` received them, from any thread, once `flush`
    is called (callbacks queued and never flushed never run).

    Args:
        loop: the event loop that runs them.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._pending: deque[tuple[Callable[..., object], tuple]] = deque()
        self._scheduled = False

    def call(self, fn: Callable[..., object], *args) -> None:
        """Queue `fn(*args)` for the loop; it runs after the next `flush`."""
        with self._lock:
            self._pending.append((fn, args))

    def flush(self) -> None:
        """Wake the loop to run everything queued, unless nothing is or a drain is on its way.

        Raises RuntimeError (from `call_soon_threadsafe`) if the loop is closed.
        """
        with self._lock:
            if self._scheduled or not self._pending:
                return
            self._scheduled = True
        self.loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self._lock:
            batch, self._pending = self._pending, deque()
            self._scheduled = False
        for fn, args in batch:
            try:
                fn(*args)
            except Exception as exc:  # noqa: BLE001 — as the loop treats a failing callback
                self.loop.call_exception_handler({"message": "LoopHandoff callback failed",
                                                  "exception": exc})
