"""Scheduler events on request spans: admitted, preempted and readmitted (the servicer adds
queued, first token and finished itself).

The servicer only sees token events; admission and preemption happen inside the scheduler,
which lists them on each step's plan (`StepPlan.lifecycle`). `SpanTracker` is a step listener:
after every engine step it adds each traced request's lifecycle events to its span, stamped
with the scheduler's clock. Only recording spans are tracked, so with tracing off it does
nothing.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from opentelemetry import trace

from engine.core.engine import Engine
from engine.core.plan import Lifecycle, StepPlan
from engine.core.request import Request


@dataclass(slots=True)
class _Tracked:
    request: Request
    span: trace.Span


class SpanTracker:
    """Adds `admitted` / `preempted` / `readmitted` events to the spans of traced requests (see
    module doc)."""

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
                self._tracked[id(sample)] = _Tracked(sample, span)

    def untrack(self, req: Request) -> None:
        with self._lock:
            for sample in (req, *req.children):
                self._tracked.pop(id(sample), None)

    def on_step(self, plan: StepPlan, events, step_s) -> None:  # noqa: ARG002 — the step listener signature
        if not self._tracked or not plan.lifecycle:
            return
        with self._lock:
            changes = [(self._tracked.get(id(e.request)), e) for e in plan.lifecycle]
        for t, e in changes:
            if t is None:
                continue
            req = t.request
            attrs = {"genserve.index": req.index}
            if e.kind is Lifecycle.ADMITTED:
                t.span.add_event("admitted", {**attrs, "genserve.queue_ms": (e.time_s - req.stats.arrival_s) * 1000},
                                 timestamp=self._wall_ns(e.time_s))
            elif e.kind is Lifecycle.READMITTED:
                t.span.add_event("readmitted", attrs, timestamp=self._wall_ns(e.time_s))
            else:
                t.span.add_event("preempted", {**attrs, "genserve.tokens_generated": len(req.generated)},
                                 timestamp=self._wall_ns(e.time_s))

    def _wall_ns(self, engine_time_s: float) -> int:
        """An engine clock time as epoch nanoseconds (what span events are stamped with)."""
        return time.time_ns() - int((self.engine.clock() - engine_time_s) * 1e9)
