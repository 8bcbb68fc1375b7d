"""Scheduler events on request spans: admitted and preempted (the servicer adds queued, first
token and finished itself).

The servicer only sees token events; admission and preemption happen inside the scheduler.
`SpanTracker` is a step listener: after every engine step (on the scheduler thread, the only
thread that changes `Request.state`) it compares each traced request's state with the last one
it saw and adds the matching span event, stamped with the request's own clock times where it
has them. Only recording spans are tracked, so with tracing off it does nothing.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from opentelemetry import trace

from engine.core.engine import Engine
from engine.core.request import Request, RequestState

_RUNNING = (RequestState.RUNNING,)


@dataclass(slots=True)
class _Tracked:
    request: Request
    span: trace.Span
    last_state: RequestState
    admitted: bool = False


class SpanTracker:
    """Adds `admitted` / `preempted` events to the spans of traced requests (see module doc)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._lock = threading.Lock()
        self._tracked: dict[int, _Tracked] = {}
        engine.step_listeners.append(self.on_step)

    def track(self, req: Request, span: trace.Span) -> None:
        """Follow `req` and its samples (call before submitting it)."""
        if not span.is_recording():
            return
        with self._lock:
            for sample in (req, *req.children):
                self._tracked[id(sample)] = _Tracked(sample, span, sample.state)

    def untrack(self, req: Request) -> None:
        with self._lock:
            for sample in (req, *req.children):
                self._tracked.pop(id(sample), None)

    def on_step(self, plan, events, step_s) -> None:  # noqa: ARG002 — the step listener signature
        if not self._tracked:
            return
        with self._lock:
            tracked = list(self._tracked.values())
        for t in tracked:
            req, state = t.request, t.request.state
            if state == t.last_state:
                continue
            attrs = {"genserve.index": req.index}
            if not t.admitted and req.admitted_s is not None and req.parent is None:
                t.admitted = True
                t.span.add_event("admitted", {**attrs, "genserve.queue_ms": (req.admitted_s - req.arrival_s) * 1000},
                                 timestamp=self._wall_ns(req.admitted_s))
            elif state in _RUNNING and t.last_state == RequestState.PREEMPTED:
                t.span.add_event("readmitted", attrs)
            if state == RequestState.PREEMPTED:
                t.span.add_event("preempted", {**attrs, "genserve.tokens_generated": len(req.generated)})
            t.last_state = state

    def _wall_ns(self, engine_time_s: float) -> int:
        """An engine clock time as epoch nanoseconds (what span events are stamped with)."""
        return time.time_ns() - int((self.engine.clock() - engine_time_s) * 1e9)
