"""The scheduler thread: the only thread that calls the executor.

Each pass is schedule → execute → update → push: the loop's leave, join, build, forward, sample
and push steps (docs/design.md, "The loop"). `submit` and `cancel` are thread-safe; they take the
engine lock only for the scheduler's bookkeeping, never across a forward pass, and the loop pushes
token ids through each request's `on_event` callback, which must not block (the service hands them
to its event loop), so the loop never waits on a socket.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence

from engine.config import EngineConfig
from engine.core.block_pool import BlockPool
from engine.core.cost_model import CostModel
from engine.core.executor import Executor
from engine.core.outputs import TokenEvent
from engine.core.plan import StepPlan
from engine.core.request import Request
from engine.core.sched.scheduler import Scheduler, SchedulerStats
from engine.core.snapshot import SchedulerState, read_scheduler

log = logging.getLogger(__name__)


class EngineUnavailable(RuntimeError):
    """The engine has stopped or its loop failed; new requests cannot be served (HTTP 503)."""


StepListener = Callable[[StepPlan, list[TokenEvent], float], None]


class Engine:
    """Owns the scheduler, the block pool and the executor, and runs the step loop.

    Args:
        config: engine dials; the block pool is built from them (`block_size`,
            `prefix_caching`).
        executor: `ModelRunner` or `SimExecutor`.
        num_blocks: blocks of the pool, as many as the executor's KV cache holds; None:
            `config.num_blocks`.
        kv_windows: the pool's KV groups, each None (global) or its sliding window in tokens
            (`engine.core.kv_groups.KVGroups.windows`; the executor's KV cache has the same
            groups); default one global group.
        cost_model: the per-token costs admission control and the step budget predict steps with
            (None: the design's, `CostModel()`); the scheduler owns it from here on.
        clock: seconds, monotonic (tests pass a fake one).
    The engine's `config` is `config`, or a copy with `max_context` lowered (logged) to the
    longest request the pool holds alone (`BlockPool.max_request_tokens`), so a request that
    could never be admitted is refused by validation (400, which reads the engine's config)
    rather than left waiting until its deadline.

    Raises:
        ValueError: neither `num_blocks` nor `config.num_blocks` gives the pool's size, or the
            pool holds no request.

    Attributes:
        pool: the block pool the executor's KV cache is indexed by.
        scheduler: the policy (read its `stats()` under `lock`).
        num_steps: forward passes run so far.
        error: the exception that stopped the loop, or None.
        calibrate_costs: fold measured step times into the scheduler's cost model (real model
            only; the simulator's costs are exact by construction).
        last_step_predicted_s: the cost model's prediction of the last step's time, seconds,
            made when the step was built (metrics compare it with the measured time).
        step_listeners: called after every pass with (plan, events, step seconds); the plan is
            empty (and the time 0) when a pass only ended requests. Used by metrics and by tests
            that count steps. Must not block.
    """

    def __init__(self, config: EngineConfig, executor: Executor, num_blocks: int | None = None, *,
                 kv_windows: Sequence[int | None] = (None,), cost_model: CostModel | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        num_blocks = num_blocks if num_blocks is not None else config.num_blocks
        if not num_blocks:
            raise ValueError("the engine's block pool needs num_blocks (or config.num_blocks)")
        self.config = config
        self.executor = executor
        self.pool = BlockPool.from_config(config, num_blocks, kv_windows)
        self.clock = clock
        self.scheduler = Scheduler(config, self.pool, cost_model)
        fits = self.pool.max_request_tokens(self.scheduler.budget.request_step_tokens(), config.max_context)
        if fits == 0:
            raise ValueError(f"a KV pool of {num_blocks} blocks holds no request")
        if fits < config.max_context:
            # a longer request could never be admitted: it would wait until its deadline, so the
            # limit is lowered (on this engine's copy of the config) and the API refuses it (400)
            log.warning("the KV pool (%d blocks of %d tokens) holds one request of at most %d "
                        "tokens; max_context lowered from %d", num_blocks, config.block_size, fits,
                        config.max_context)
            self.config = dataclasses.replace(config, max_context=fits)
            self.scheduler = Scheduler(self.config, self.pool, cost_model)
        self.lock = threading.Lock()
        self._wake = threading.Condition(self.lock)
        self._requests: dict[str, Request] = {}      # client-visible id → request (sample 0)
        self._open_samples: dict[str, int] = {}      # client-visible id → samples not finished
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.num_steps = 0
        self.error: BaseException | None = None
        self.step_listeners: list[StepListener] = []
        self.calibrate_costs = False
        self.last_step_predicted_s = 0.0

    # -- thread-safe API ------------------------------------------------------------------------
    def submit(self, req: Request) -> None:
        """Queue `req` (its arrival time is stamped here).

        Raises:
            EngineUnavailable: the loop failed or is stopping.
            AdmissionRejected: the queue is over its device-seconds budget (429).
            ValueError: duplicate request id.
        """
        with self.lock:
            if self.error is not None or self._stopping:
                raise EngineUnavailable(f"engine unavailable: {self.error or 'stopping'}")
            now = self.clock()
            req.stats.arrival_s = now
            if req.deadline_s <= 0:
                req.deadline_s = now + self.config.default_deadline_s
            self.scheduler.add(req, now)
            self._requests[req.request_id] = req
            self._open_samples[req.request_id] = req.n
            self._wake.notify()

    def cancel(self, request_id: str, api_key: str | None = None) -> bool:
        """Flag a request for cancellation at the next step boundary.

        Args:
            request_id: the request.
            api_key: when given, only a request created with this key is cancelled.
        Returns:
            True when a live request was flagged; False when unknown, finished, or another key's.
        """
        with self.lock:
            req = self._requests.get(request_id)      # present until every sample finished
            if req is None or (api_key is not None and req.api_key != api_key):
                return False
            self.scheduler.cancel(req)
            self._wake.notify()
            return True

    def stop_sample(self, request_id: str, index: int = 0) -> bool:
        """Finish sample `index` of `request_id` with STOP at the next step boundary.

        Used by the service when a stop string matched. Returns False when it is not running.
        """
        with self.lock:
            req = self._requests.get(request_id)
            samples = [] if req is None else [req, *req.children]
            if index >= len(samples) or samples[index].finished:
                return False
            self.scheduler.stop(samples[index])
            self._wake.notify()
            return True

    def stats(self) -> SchedulerStats:
        """A consistent snapshot of queue, rows and pool."""
        with self.lock:
            return self.scheduler.stats()

    def scheduler_state(self) -> SchedulerState:
        """The scheduler's queues per key, rows and KV pool block by block, read at one instant
        (`engine.core.snapshot.read_scheduler`, under the lock; ≈ 1 ms for 6,000 blocks)."""
        with self.lock:
            return read_scheduler(self.scheduler, self.num_steps)

    # -- the loop -------------------------------------------------------------------------------
    def step(self) -> bool:
        """One pass: schedule, execute, update, push. Returns False when there was nothing to do."""
        with self.lock:
            plan = self.scheduler.schedule(self.clock())
            features = plan.features()
            self.last_step_predicted_s = self.scheduler.cost.step_ms(features) / 1000.0
        if plan.empty:
            self._emit(plan, plan.events, 0.0)
            return bool(plan.events)
        t0 = time.perf_counter()
        sampled = self.executor.execute(plan)
        step_s = time.perf_counter() - t0
        with self.lock:
            events = self.scheduler.update(plan, sampled, self.clock())
            self.num_steps += 1
            if self.calibrate_costs:
                self.scheduler.cost.observe(features, step_s)
        self._emit(plan, events, step_s)
        return True

    def run_until_idle(self, max_steps: int = 1_000_000) -> int:
        """Run steps on the calling thread until nothing is queued or running (tests, tools).

        Returns the number of steps run. Raises RuntimeError after `max_steps` passes of the loop,
        counting those that ran no forward pass (a request that never fits would otherwise keep
        it busy for ever).
        """
        start = self.num_steps
        for _ in range(max_steps + 1):
            with self.lock:
                busy = self.scheduler.has_work
            if not busy:
                return self.num_steps - start
            self.step()
        raise RuntimeError(f"engine still busy after {max_steps} passes ({self.num_steps - start} steps)")

    def start(self) -> None:
        """Start the scheduler thread (daemon).

        Every step then runs its kernels' parallel regions from that thread. Build the engine on a
        thread that has exited by then (as `service.server.EngineServer.load` does), not on the
        caller's own long-lived thread: OpenMP (libgomp) keeps a pool of worker threads per
        thread that ever ran a parallel region, and once its workers outnumber the cores it stops
        spin-waiting between regions, so every region pays a wake-up. The measurement is in
        benchmarks/results/kernels/history.md ("One OpenMP pool"; docs/benchmarks/kernels.md sums
        it up).
        """
        self._thread = threading.Thread(target=self._run, name="genserve-scheduler", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the loop after the current step; running requests are not finished."""
        with self.lock:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        """True while the scheduler thread runs and has not failed."""
        return self._thread is not None and self._thread.is_alive() and self.error is None

    def _run(self) -> None:
        try:
            while True:
                with self.lock:
                    while not self._stopping and not self.scheduler.has_work:
                        self._wake.wait(0.1)
                    if self._stopping:
                        return
                self.step()
        except BaseException as exc:  # noqa: BLE001 — every open stream must hear about it
            log.exception("engine loop failed")
            with self.lock:
                self.error = exc
                events = self.scheduler.fail_all(self.clock(), f"engine failure: {exc}")
            self._emit(StepPlan(), events, 0.0)

    def _emit(self, plan: StepPlan, events: list[TokenEvent], step_s: float) -> None:
        """Push events to their requests, then tell the listeners (an empty plan ran nothing)."""
        self._push(events)
        for listener in self.step_listeners:
            listener(plan, events, step_s)

    def _push(self, events: list[TokenEvent]) -> None:
        for ev in events:
            with self.lock:
                req = self._requests.get(ev.request_id)
                if ev.finish_reason is not None and req is not None:
                    self._open_samples[ev.request_id] -= 1
                    if self._open_samples[ev.request_id] == 0:
                        del self._requests[ev.request_id], self._open_samples[ev.request_id]
            if req is None or req.on_event is None:
                continue
            try:
                req.on_event(ev)
            except Exception:  # noqa: BLE001 — a broken consumer must not stop the loop
                log.exception("on_event failed for %s", ev.request_id)
