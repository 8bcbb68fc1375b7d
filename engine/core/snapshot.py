"""Scheduler snapshots: what the continuous batch looks like now and over the last minute.

A snapshot is read-only and carries no per-request text or token ids: counts per API key, the
KV pool block by block, the recent steps' sizes and times, and latency summaries of the requests
that finished in the last minute. The service streams them to the console (`WatchScheduler`).

Two halves:

* `read_scheduler` reads the scheduler and its block pool at one instant (the caller holds the
  engine lock; `Engine.scheduler_state` does that);
* `StepHistory` is a step listener that remembers the recent steps and the latencies of recently
  finished requests (it runs on the scheduler thread, and is read from others).

`SnapshotSource` joins them into one `SchedulerSnapshot`. No torch here (the scheduling core
imports none).
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from engine.core.outputs import TokenEvent
from engine.core.plan import StepPlan

# Block states in `SchedulerState.kv_block_states`, one byte per block.
BLOCK_FREE = 0        # held by no request, holding nothing reusable
BLOCK_USED = 1        # held by one request
BLOCK_SHARED = 2      # held by several (samples of one request, or requests sharing a prefix)
BLOCK_CACHED = 3      # held by no request, keeping a prompt prefix for reuse (prefix caching)

RECENT_STEPS = 120            # steps kept for the console's step chart
LATENCY_WINDOW_S = 60.0       # finished requests summarised in the latency figures (s)
MAX_FINISHED_KEPT = 4096      # bound of the latency window's memory (most recent kept)


@dataclass(frozen=True, slots=True)
class KeyQueue:
    """One API key's requests in the scheduler.

    Attributes:
        key: the API key itself (the service shows its configured name instead; never sent out).
        queued: requests waiting for admission (preempted ones included).
        running: rows of the running batch that belong to the key (samples count one each).
    """

    key: str
    queued: int
    running: int


@dataclass(frozen=True, slots=True)
class SchedulerState:
    """The scheduler at one instant (read under the engine lock).

    Attributes:
        steps: forward passes run so far.
        running_rows: requests (samples) in the running batch.
        prefill_rows: of those, how many are still computing their prompt (or replaying after a
            preemption).
        max_rows: the batch's row cap (`EngineConfig.max_rows`).
        queues: per API key, sorted by key.
        queued_device_s: estimated device-seconds of queued work (s).
        queue_budget_s: the device-seconds above which a new request is refused with 429 (s).
        block_size: tokens per KV block.
        kv_block_states: one byte per KV block, `BLOCK_FREE` / `BLOCK_USED` / `BLOCK_SHARED` /
            `BLOCK_CACHED`, indexed by block id; its length is the pool's block count.
        kv_blocks_free: blocks free for new work and holding nothing reusable.
        kv_blocks_cached: blocks no request holds that keep a prompt prefix for reuse (prefix
            caching; they are taken back when the free ones run out); `BLOCK_CACHED` in the
            block map.
        rejected_total: requests refused for the queue budget (429) since start.
        preemptions_total: preemptions since start.
        finished_total: requests ended since start.
        adapters: (LoRA adapter name, running rows, queued requests) of every adapter with work,
            sorted by name.
    """

    steps: int
    running_rows: int
    prefill_rows: int
    max_rows: int
    queues: tuple[KeyQueue, ...]
    queued_device_s: float
    queue_budget_s: float
    block_size: int
    kv_block_states: bytes
    kv_blocks_free: int
    kv_blocks_cached: int
    rejected_total: int
    preemptions_total: int
    finished_total: int
    adapters: tuple[tuple[str, int, int], ...] = ()


def read_scheduler(scheduler, steps: int) -> SchedulerState:
    """Read `scheduler` (an `engine.core.sched.scheduler.Scheduler`) and its pool through their public
    attributes. The caller holds the engine lock. Costs one pass over the pool's blocks
    (≈ 1 ms for 6,000 blocks)."""
    pool = scheduler.pool
    running: dict[str, int] = {}
    prefill_rows = 0
    for req in scheduler.running:
        running[req.api_key] = running.get(req.api_key, 0) + 1
        if req.is_prefilling:
            prefill_rows += 1
    adapters: dict[str, list[int]] = {}
    for req in scheduler.running:
        if req.lora is not None:
            adapters.setdefault(req.lora.name, [0, 0])[0] += 1
    for q in scheduler.queue.waiting.values():
        for req in q:
            if req.lora is not None:
                adapters.setdefault(req.lora.name, [0, 0])[1] += 1
    keys = sorted(set(running) | {k for k, q in scheduler.queue.waiting.items() if q})
    queues = tuple(KeyQueue(k, len(scheduler.queue.waiting.get(k, ())), running.get(k, 0)) for k in keys)
    states = bytearray(min(pool.ref_count(b), BLOCK_SHARED) for b in range(pool.num_blocks))
    cached_unused = pool.cached_unused_blocks()
    for b in cached_unused:
        states[b] = BLOCK_CACHED
    cached = len(cached_unused)      # counted among the pool's free blocks: take them out
    return SchedulerState(
        steps=steps, running_rows=len(scheduler.running), prefill_rows=prefill_rows,
        max_rows=scheduler.config.max_rows, queues=queues,
        queued_device_s=scheduler.queue.queued_device_ms / 1000.0,
        queue_budget_s=scheduler.config.queue_budget_s, block_size=pool.block_size,
        kv_block_states=bytes(states), kv_blocks_free=pool.num_free - cached, kv_blocks_cached=cached,
        rejected_total=scheduler.admission.num_rejected, preemptions_total=scheduler.num_preemptions,
        finished_total=scheduler.num_finished,
        adapters=tuple((name, run, wait) for name, (run, wait) in sorted(adapters.items())))


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One forward pass, for the step chart.

    Attributes:
        end_s: when it ended, engine clock (s, monotonic).
        decode_rows: decode rows (one token each).
        prefill_tokens: prompt tokens computed (prefill chunks, replayed tokens included).
        decode_ms / prefill_ms: the step's measured time split between decode and prefill in
            proportion to the cost model's estimate of each part (rows × decode ms/token against
            tokens × prefill ms/token); they add up to the measured step time (ms). A step runs
            both in one forward pass, so the split is an attribution, not two timings.
    """

    end_s: float
    decode_rows: int
    prefill_tokens: int
    decode_ms: float
    prefill_ms: float


@dataclass(frozen=True, slots=True)
class LatencySummary:
    """A latency over the requests of the window: count, median, 95th percentile, maximum (ms;
    0 when count is 0). Percentiles are nearest-rank."""

    count: int
    p50_ms: float
    p95_ms: float
    max_ms: float

    @classmethod
    def of(cls, values_ms: Iterable[float]) -> "LatencySummary":
        """Summarise `values_ms` (ms)."""
        ordered = sorted(values_ms)
        if not ordered:
            return cls(0, 0.0, 0.0, 0.0)
        return cls(len(ordered), _nearest_rank(ordered, 0.50), _nearest_rank(ordered, 0.95), ordered[-1])


def _nearest_rank(ordered: list[float], q: float) -> float:
    """The nearest-rank q-quantile of a sorted, non-empty list."""
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


@dataclass(frozen=True, slots=True)
class _Finished:
    end_s: float
    ttft_ms: float | None
    tpot_ms: float | None
    max_gap_ms: float | None


class StepHistory:
    """Step listener: the last `RECENT_STEPS` steps and the requests finished in the last
    `LATENCY_WINDOW_S` seconds (at most `MAX_FINISHED_KEPT` of them).

    Args:
        cost_model: the scheduler's `CostModel` (read at each step for the decode/prefill split).
        clock: the engine's clock (s, monotonic).
    """

    def __init__(self, cost_model, clock: Callable[[], float]) -> None:
        self.cost_model = cost_model
        self.clock = clock
        self._lock = threading.Lock()
        self._steps: deque[StepRecord] = deque(maxlen=RECENT_STEPS)
        self._finished: deque[_Finished] = deque(maxlen=MAX_FINISHED_KEPT)

    def on_step(self, plan: StepPlan, events: list[TokenEvent], step_s: float) -> None:
        """Record one pass (the engine's step listener signature; scheduler thread)."""
        now = self.clock()
        record = None
        if not plan.empty:
            rows, tokens = plan.num_decode_rows, plan.num_prefill_tokens
            decode_est = rows * self.cost_model.decode_ms_per_token
            prefill_est = tokens * self.cost_model.prefill_ms_per_token
            total_ms = step_s * 1000.0
            share = decode_est / (decode_est + prefill_est) if decode_est + prefill_est > 0 else 1.0
            record = StepRecord(now, rows, tokens, total_ms * share, total_ms * (1.0 - share))
        finished = [_Finished(now, ev.ttft_ms, ev.tpot_ms, ev.max_gap_ms if ev.tpot_ms is not None else None)
                    for ev in events if ev.finish_reason is not None]
        with self._lock:
            if record is not None:
                self._steps.append(record)
            self._finished.extend(finished)

    def steps(self) -> tuple[StepRecord, ...]:
        """The recent steps, oldest first."""
        with self._lock:
            return tuple(self._steps)

    def latencies(self) -> tuple[LatencySummary, LatencySummary, LatencySummary]:
        """TTFT, TPOT and longest inter-token gap of the requests finished in the last
        `LATENCY_WINDOW_S` seconds."""
        since = self.clock() - LATENCY_WINDOW_S
        with self._lock:
            recent = [f for f in self._finished if f.end_s >= since]
        return (LatencySummary.of(f.ttft_ms for f in recent if f.ttft_ms is not None),
                LatencySummary.of(f.tpot_ms for f in recent if f.tpot_ms is not None),
                LatencySummary.of(f.max_gap_ms for f in recent if f.max_gap_ms is not None))


@dataclass(frozen=True, slots=True)
class SchedulerSnapshot:
    """Everything the console's live view shows, at one instant.

    Attributes:
        time_s: when it was taken, engine clock (s, monotonic); `steps[i].end_s` is on the same clock.
        state: the scheduler and its KV pool.
        steps: the recent steps, oldest first.
        ttft, tpot, max_gap: latencies of the requests finished in the last `window_s` seconds.
        window_s: the latency window (s).
    """

    time_s: float
    state: SchedulerState
    steps: tuple[StepRecord, ...]
    ttft: LatencySummary
    tpot: LatencySummary
    max_gap: LatencySummary
    window_s: float = LATENCY_WINDOW_S


class SnapshotSource:
    """Snapshots of one engine: attaches a `StepHistory` to it as a step listener.

    Args:
        engine: the `engine.core.engine.Engine` to observe.
    """

    def __init__(self, engine) -> None:
        self.engine = engine
        self.history = StepHistory(engine.scheduler.cost, engine.clock)
        engine.step_listeners.append(self.history.on_step)

    def snapshot(self) -> SchedulerSnapshot:
        """The engine now (takes the engine lock for `Engine.scheduler_state`)."""
        state = self.engine.scheduler_state()
        ttft, tpot, max_gap = self.history.latencies()
        return SchedulerSnapshot(time_s=self.engine.clock(), state=state, steps=self.history.steps(),
                                 ttft=ttft, tpot=tpot, max_gap=max_gap)
