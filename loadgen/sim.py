"""The virtual-time driver: the real scheduler and engine loop, a cost model in place of the GPU.

`simulate(items)` runs a workload through `engine.core.engine.Engine` — the same `Scheduler`, block pool,
admission control, fair queueing, chunked prefill and preemption as the server — over
`engine.core.sim_executor.SimExecutor`, whose step time is the design's cost model (25 ms for one decode
row to 40 ms for 32, plus 0.1 ms per prefill token). Nothing sleeps: a virtual clock jumps by each
step's modelled time (`SimExecutor.last_step_s`) and, when the engine is idle, to the next arrival
(or, under static/dynamic batching, to when the batcher's window closes: `Scheduler.join_wait_s`).

Order of one pass, as on the server:

1. every arrival whose time has come is submitted, with the clock set to its own arrival time
   (so the engine stamps `arrival_s` exactly; a request arriving mid-step waits for the step to
   end, as it would on a real device);
2. `Engine.step()`: schedule → execute (the clock advances by the step's time) → update → push;
   TokenEvents reach the per-request trackers with the clock at the step's end, which is when
   the tokens exist.

Per request the driver records the same `RequestRecord` a live client does (TTFT from arrival to
first token, TPOT, max gap, queue wait from the final event's `queue_ms`, end-to-end, status:
200, 429 from `AdmissionRejected`, 400 for prompt + max_tokens over the context limit). Per step
it records a `StepRow` (decode rows, prefill tokens, running rows, queue depth, free blocks,
preemptions), summarised into rows per step, pool use, preemptions, 429s and cancelled tokens.

Default scale is the design's: EngineConfig(num_blocks=7152, block_size=16, max_rows=32,
prefill_token_budget=256) and SimExecutor's default costs.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine.config import EngineConfig
from engine.core.cost_model import CostModel
from engine.core.engine import Engine
from engine.core.outputs import FinishReason, SampledTokens, TokenEvent
from engine.core.plan import StepPlan
from engine.core.request import Request, SamplingParams
from engine.core.sched.admission import AdmissionRejected
from engine.core.sim_executor import SimExecutor
from loadgen.stats import RequestRecord, STATUS_OK, STATUS_REJECTED, TokenTimer
from loadgen.workload import WorkItem

IDLE_TICK_S = 0.001     # clock advance when work is queued but nothing could run (never expected)
DESIGN_NUM_BLOCKS = 7152


def design_config(**overrides: Any) -> EngineConfig:
    """The reference deployment's engine (docs/design.md): 7,152 blocks of 16 tokens, 32 rows,
    256-token prefill budget, and no prefix caching: the design's load test draws prompts of
    token 1 repeated (`simulate`'s default), which a prefix cache would all hit, so a simulated
    run turns it on only when asked (`prefix_caching=True`)."""
    settings: dict[str, Any] = dict(num_blocks=DESIGN_NUM_BLOCKS, block_size=16, max_rows=32, prefill_token_budget=256,
                                    prefix_caching=False)
    settings.update(overrides)
    return EngineConfig(**settings)


class VirtualClock:
    """The engine's clock in virtual seconds; the driver moves it."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class VirtualTimeExecutor:
    """Runs the `SimExecutor` and advances the virtual clock by the step's modelled time.

    The engine reads its clock after `execute` returns, so `Scheduler.update` sees the step's end.
    """

    def __init__(self, sim: SimExecutor, clock: VirtualClock) -> None:
        self.sim = sim
        self.clock = clock
        self.num_steps = 0

    def execute(self, plan: StepPlan) -> SampledTokens:
        sampled = self.sim.execute(plan)
        self.clock.now += self.sim.last_step_s
        self.num_steps += 1
        return sampled


@dataclass(frozen=True, slots=True)
class StepRow:
    """One executed step.

    Attributes:
        start_s: virtual time the step began.
        step_s: its modelled duration (`SimExecutor.step_seconds` of its features).
        num_rows: segments in the step (decode rows + prefill chunks): the batch's rows.
        num_decode_rows / num_prefill_tokens: B and C of the step (as SimExecutor counts them).
        num_running: rows admitted after the step (decoding or prefilling).
        queue_depth: requests waiting after the step.
        kv_blocks_free: free blocks after the step.
        num_preempted: requests preempted while building the step.
        decode_context / prefill_pairs: K and P of the step (context tokens read by the decode
            rows, prefill attention pairs; see SimExecutor).
    """

    start_s: float
    step_s: float
    num_rows: int
    num_decode_rows: int
    num_prefill_tokens: int
    num_running: int
    queue_depth: int
    kv_blocks_free: int
    num_preempted: int
    decode_context: int = 0
    prefill_pairs: int = 0


@dataclass(slots=True)
class SimResult:
    """Records in workload order, step rows, and the engine's counters."""

    records: list[RequestRecord]
    steps: list[StepRow]
    config: EngineConfig
    num_preemptions: int = 0
    num_rejected: int = 0
    num_cancelled_tokens: int = 0
    kv_blocks_free_end: int = 0
    virtual_s: float = 0.0
    wall_s: float = 0.0
    unfinished: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def engine_summary(self) -> dict[str, Any]:
        """Rows per step, pool use (step-time weighted), preemptions, 429s, timings."""
        n = len(self.steps)
        total = self.config.num_blocks
        if n:
            arr = np.array([(s.step_s, s.num_rows, s.num_decode_rows,
                             s.num_prefill_tokens, s.kv_blocks_free) for s in self.steps], dtype=np.float64)
            w, rows, decode, prefill, free = arr.T
            use = 1.0 - free / total
            busy = float(w.sum())
            rows_stats = {"mean": float(rows.mean()), "p50": float(np.percentile(rows, 50)),
                          "p95": float(np.percentile(rows, 95)), "max": float(rows.max())}
            pool = {"mean": float((use * w).sum() / busy) if busy else 0.0, "max": float(use.max())}
            prefill_mean, decode_mean = float(prefill.mean()), float(decode.mean())
        else:
            busy, prefill_mean, decode_mean = 0.0, 0.0, 0.0
            rows_stats = {"mean": None, "p50": None, "p95": None, "max": None}
            pool = {"mean": None, "max": None}
        return {
            "num_steps": n,
            "rows_per_step": rows_stats,
            "decode_rows_per_step_mean": decode_mean,
            "prefill_tokens_per_step_mean": prefill_mean,
            "pool_use": pool,
            "busy_fraction": busy / self.virtual_s if self.virtual_s else None,
            "num_preemptions": self.num_preemptions,
            "num_rejected": self.num_rejected,
            "num_cancelled_tokens": self.num_cancelled_tokens,
            "kv_blocks_total": total,
            "kv_blocks_free_end": self.kv_blocks_free_end,
            "unfinished": self.unfinished,
            "virtual_s": self.virtual_s,
            "wall_s": self.wall_s,
            **self.extra,
        }


class _Tracker:
    """Follows one request's TokenEvents into its RequestRecord (the client's view)."""

    __slots__ = ("item", "record", "timer", "clock", "engine", "request_id", "done", "tokens_after_disconnect")

    def __init__(self, item: WorkItem, record: RequestRecord, clock: VirtualClock, engine: Engine) -> None:
        self.item = item
        self.record = record
        self.timer = TokenTimer(item.arrival_s)
        self.clock = clock
        self.engine = engine
        self.request_id = ""
        self.done = False
        self.tokens_after_disconnect = 0

    def on_event(self, ev: TokenEvent) -> None:
        now = self.clock.now
        rec = self.record
        if rec.disconnected:                  # the client is gone: count what it still cost
            if ev.token_id is not None:
                self.tokens_after_disconnect += 1
            if ev.finish_reason is not None:
                self.done = True
            return
        if ev.token_id is not None:
            self.timer.token(now)
        if ev.finish_reason is not None:
            self.timer.fill(rec)
            rec.status = STATUS_OK
            rec.finish_reason = ev.finish_reason.value
            if ev.finish_reason == FinishReason.ERROR:
                rec.error = ev.finish_detail or "engine error"
            rec.queue_s = None if ev.queue_ms is None else ev.queue_ms / 1000.0
            rec.e2e_s = now - self.item.arrival_s
            self.done = True
            return
        k = self.item.disconnect_after
        if k is not None and self.timer.count >= k:
            self.timer.fill(rec)
            rec.status = STATUS_OK
            rec.disconnected = True
            rec.e2e_s = now - self.item.arrival_s
            self.engine.cancel(self.request_id)   # flag; the loop drops the row at the next step


def simulate(items: Sequence[WorkItem], config: EngineConfig | None = None,
             executor: SimExecutor | None = None, *, max_retries: int = 0,
             time_limit_s: float | None = None, request_prefix: str = "sim-", submit_delay_s: float = 0.0,
             progress: Callable[[int], None] | None = None) -> SimResult:
    """Run `items` through the real engine in virtual time.

    Args:
        items: the workload (any order; arrival_s decides).
        config: engine dials; default `design_config()`. Needs `num_blocks`.
        executor: the cost model; default `SimExecutor()` (the design's costs).
        max_retries: a 429 is retried after its Retry-After this many times (0: open loop only).
        time_limit_s: stop at this virtual time; requests still open get status 0, "unfinished".
            A static batch that no later arrival can fill also ends the run that way.
        request_prefix: prefix of the engine request ids.
        submit_delay_s: the request path's latency (client → bridge → tokenizer → engine): each
            request reaches the engine this long after its arrival; its TTFT still counts from
            the arrival. 0 models the engine alone.
        progress: called with the number of requests that just reached their outcome.
    Returns:
        A SimResult whose records are in `items` order.
    """
    config = config or design_config()
    if config.num_blocks is None:
        raise ValueError("the simulator needs config.num_blocks")
    sim = executor or SimExecutor()
    clock = VirtualClock()
    vexec = VirtualTimeExecutor(sim, clock)
    engine = Engine(config, vexec, cost_model=CostModel(**sim.device_costs.params(), refit_every=0),
                    clock=clock)
    pool = engine.pool
    steps: list[StepRow] = []

    def on_step(plan: StepPlan, events: list[TokenEvent], _wall_s: float) -> None:
        if plan.empty:
            return
        sched = engine.scheduler
        _, _, context, pairs = plan.features().as_tuple()
        steps.append(StepRow(clock.now - sim.last_step_s, sim.last_step_s, len(plan.segments), plan.num_decode_rows,
                             plan.num_prefill_tokens, len(sched.running), sched.queue.depth,
                             pool.num_free, plan.num_preempted, context, pairs))

    engine.step_listeners.append(on_step)
    records = [RequestRecord(f"{request_prefix}{it.index}", it.api_key, it.arrival_s, it.prompt_tokens,
                             it.output_tokens) for it in items]
    pending = [(it.arrival_s + submit_delay_s, i, 0) for i, it in enumerate(items)]
    heapq.heapify(pending)
    open_trackers: list[_Tracker] = []
    wall0 = time.perf_counter()

    def submit(i: int, attempt: int, at: float) -> None:
        item, rec = items[i], records[i]
        rec.retries = attempt
        if item.prompt_tokens + item.output_tokens > config.max_context or item.output_tokens > config.max_new_tokens:
            rec.status, rec.error = 400, "prompt + max_tokens over the context limit"
            _done(1)
            return
        tracker = _Tracker(item, rec, clock, engine)
        tracker.request_id = rec.request_id if attempt == 0 else f"{rec.request_id}.{attempt}"
        prompt = list(item.prompt) if isinstance(item.prompt, tuple) else [1] * item.prompt_tokens
        req = Request(tracker.request_id, item.api_key, prompt, item.output_tokens,
                      SamplingParams(ignore_eos=True), 0.0, 0.0, on_event=tracker.on_event)
        step_end = clock.now
        clock.now = at                       # the engine stamps the true arrival time
        try:
            engine.submit(req)
        except AdmissionRejected as exc:
            if attempt < max_retries:
                heapq.heappush(pending, (at + exc.retry_after_s, i, attempt + 1))
            else:
                rec.status, rec.error = STATUS_REJECTED, f"429 retry after {exc.retry_after_s} s"
                _done(1)
            return
        finally:
            clock.now = step_end
        open_trackers.append(tracker)

    after_disconnect = 0

    def _done(n: int) -> None:
        if progress is not None and n:
            progress(n)

    def _reap() -> None:
        nonlocal after_disconnect
        keep = []
        for t in open_trackers:
            if t.done:
                after_disconnect += t.tokens_after_disconnect
            else:
                keep.append(t)
        n = len(open_trackers) - len(keep)
        open_trackers[:] = keep
        _done(n)

    while True:
        while pending and pending[0][0] <= clock.now:
            at, i, attempt = heapq.heappop(pending)
            submit(i, attempt, at)
        if not engine.scheduler.has_work:
            _reap()
            if not pending:
                break
            clock.now = pending[0][0]
            continue
        if time_limit_s is not None and clock.now >= time_limit_s:
            break
        before = vexec.num_steps
        engine.step()
        if vexec.num_steps == before:        # nothing ran (only finish events): move time on
            next_arrival = pending[0][0] if pending else math.inf
            wait = engine.scheduler.join_wait_s(clock.now)
            if wait > 0.0:                   # static/dynamic batcher waiting for its batch
                if min(next_arrival, clock.now + wait) == math.inf:
                    break                    # a static batch that no arrival will ever fill
                clock.now = min(next_arrival, clock.now + wait)
            else:
                clock.now = min(next_arrival, clock.now + IDLE_TICK_S)
        if len(open_trackers) > 256:
            _reap()
    _reap()
    unfinished = 0
    for tracker in open_trackers:
        if not tracker.record.disconnected:    # a disconnected client already has its outcome
            tracker.timer.fill(tracker.record)
            tracker.record.error = "unfinished at the end of the run"
            tracker.record.status = 0
            unfinished += 1
    for _, i, _attempt in pending:
        records[i].error, records[i].status = "not sent before the time limit", 0
        unfinished += 1
    sched = engine.scheduler
    return SimResult(records, steps, config, num_preemptions=sched.num_preemptions,
                     num_rejected=sched.admission.num_rejected, num_cancelled_tokens=sched.num_cancelled_tokens,
                     kv_blocks_free_end=pool.num_free, virtual_s=clock.now,
                     wall_s=time.perf_counter() - wall0, unfinished=unfinished,
                     extra={"tokens_after_disconnect": after_disconnect})

