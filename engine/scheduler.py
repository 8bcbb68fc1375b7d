"""Scheduling policy: fair per-key queues, admission control, chunked prefill, preemption.

Pure policy for the loop's admit, leave, join, build and preempt steps (docs/design.md, "The
loop"): it takes the time as an argument, never calls `time.*`, never touches a tensor, and so
runs unchanged in virtual time under the simulator. It is the only code that changes
`Request.state`; block ids come from `BlockPool`.

One pass of the engine loop is::

    plan = scheduler.schedule(now)          # leave, join, build the step
    sampled = executor.execute(plan)        # forward + sample
    events = scheduler.update(plan, sampled, now)   # advance requests, finish rows

Prefill pieces are aligned to multiples of `prefill_piece` (64) within each request (positions
[0, 64), [64, 128), ...), so a request's prompt is cut at the same places whether it runs alone
or beside 31 others; a step carries pieces of several requests up to its prefill budget. Together
with per-piece attention this makes every token's arithmetic independent of its batch neighbours
(the batch-invariance test of docs/design.md). A preempted request re-prefills its prompt in the same
pieces, then replays the tokens it had already produced
as one-token rows without sampling, so its cache — and its later tokens — are bit-identical to a
run without preemption.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from engine.block_pool import BlockPool
from engine.config import EngineConfig
from engine.request import FinishReason, KeyUsage, Request, RequestState
from engine.step import SampledTokens, Segment, StepPlan, TokenEvent


@dataclass(slots=True)
class CostModel:
    """Device cost per token used for admission control, in milliseconds.

    Defaults are the reference deployment's assumptions for a 7B model on one 80 GB GPU
    (docs/design.md, "The numbers"): prefill at 10,000 tokens/s (0.1 ms per prompt token) and a
    32-row decode step of 40 ms (1.25 ms per output token). The `ModelExecutor` replaces them
    with measured values.
    """

    prefill_ms_per_token: float = 0.1
    decode_ms_per_token: float = 1.25

    def observe(self, num_rows: int, num_prefill_tokens: int, step_s: float, full_rows: int) -> None:
        """Fold one measured step into the per-token costs (exponential moving average, α 0.05).

        Only clean samples count: a pure prefill step of at least 64 tokens updates the prefill
        cost; a pure decode step with at least half of `full_rows` rows updates the decode cost
        (per output token near the row cap: 40 ms / 32 rows in docs/design.md's numbers).
        """
        alpha = 0.05
        if num_rows == 0 and num_prefill_tokens >= 64:
            ms = step_s * 1000.0 / num_prefill_tokens
            self.prefill_ms_per_token += alpha * (ms - self.prefill_ms_per_token)
        elif num_prefill_tokens == 0 and num_rows >= max(1, full_rows // 2):
            ms = step_s * 1000.0 / num_rows
            self.decode_ms_per_token += alpha * (ms - self.decode_ms_per_token)

    def estimate_ms(self, num_prompt: int, expected_output: float) -> float:
        """Estimated device time of a request: prompt × prefill cost + output × decode cost (ms)."""
        return num_prompt * self.prefill_ms_per_token + expected_output * self.decode_ms_per_token


class AdmissionRejected(Exception):
    """More device work is queued than the budget allows (HTTP 429).

    Attributes:
        retry_after_s: whole seconds after which the queue should have drained enough (>= 1).
    """

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """A consistent snapshot of the scheduler's gauges and counters."""

    queue_depth: int
    queued_device_s: float
    running_rows: int
    kv_blocks_free: int
    kv_blocks_total: int
    num_preemptions: int
    num_cancelled_tokens: int
    num_rejected: int
    num_finished: int


class Scheduler:
    """Decides, step by step, which tokens of which requests the device computes.

    Args:
        config: the engine's dials (row cap, chunk, margins, fairness weights, budget).
        pool: the block pool whose free list bounds admission.
        cost: per-token device costs for admission control and the queue estimate.

    Thread-safety: none. The engine loop serialises every call behind its own lock.
    """

    def __init__(self, config: EngineConfig, pool: BlockPool, cost: CostModel | None = None) -> None:
        self.config = config
        self.pool = pool
        self.cost = cost or CostModel()
        self.waiting: dict[str, deque[Request]] = {}
        self.running: list[Request] = []          # admission order: oldest first
        self.usage: dict[str, KeyUsage] = {}
        self.by_id: dict[str, Request] = {}
        self.queued_device_ms = 0.0
        self.avg_output_tokens = 300.0             # docs/design.md: average answer of 300 tokens
        self.num_preemptions = 0
        self.num_cancelled_tokens = 0
        self.num_rejected = 0
        self.num_finished = 0
        self.margin_blocks = math.ceil(config.free_margin * pool.num_blocks)
        # Batch formation (config.batching): the gate in front of join, and whether prefill is
        # chunked. "continuous" is the default policy; the others exist for the comparison.
        self.join_wait_s = {"continuous": self._join_wait_continuous,
                            "continuous_unchunked": self._join_wait_continuous,
                            "static": self._join_wait_static,
                            "dynamic": self._join_wait_dynamic}[config.batching]
        self._chunked_prefill = config.batching == "continuous"

    # -- submission ---------------------------------------------------------------------------
    def add(self, req: Request, now: float) -> None:
        """Queue `req` under its API key, or reject it when the queue is over budget.

        Raises:
            AdmissionRejected: queued device-seconds plus this request's estimate pass
                `config.queue_budget_s` (only while something else is queued).
            ValueError: a request with the same id is already in the engine.
        """
        if req.request_id in self.by_id:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        expected = min(req.max_tokens, self.avg_output_tokens) * req.n
        req.est_device_ms = self.cost.estimate_ms(req.num_prompt, expected)
        for child in req.children:
            child.arrival_s, child.deadline_s = req.arrival_s, req.deadline_s
        budget_ms = self.config.queue_budget_s * 1000.0
        if self.queue_depth and self._over_budget(req, budget_ms):
            self.num_rejected += 1
            excess_ms = self.queued_device_ms + req.est_device_ms - budget_ms
            # The device drains one device-second of queued work per second of wall time.
            raise AdmissionRejected(
                f"{self.queued_device_ms / 1000:.2f} device-seconds queued, budget "
                f"{self.config.queue_budget_s:g} s", max(1, math.ceil(excess_ms / 1000.0)))
        usage = self.usage.setdefault(req.api_key, KeyUsage(req.api_key))
        if not self.waiting.get(req.api_key) and usage.running_rows == 0:
            # A key that becomes active starts level with the least-served active key, so
            # an idle key cannot bank credit and then starve everyone (start-time fair queueing).
            active = [u.weighted_tokens_served for k, u in self.usage.items()
                      if k != req.api_key and (u.running_rows or self.waiting.get(k))]
            if active:
                usage.weighted_tokens_served = max(usage.weighted_tokens_served, min(active))
        req.state = RequestState.QUEUED
        self.waiting.setdefault(req.api_key, deque()).append(req)
        self.by_id[req.request_id] = req
        self.queued_device_ms += req.est_device_ms

    def _over_budget(self, req: Request, budget_ms: float) -> bool:
        """Whether queueing `req` passes the budget (the admit step), with a fair share per key.

        Over the budget, a key whose own queued work (with `req`) stays within budget / active
        keys is still admitted, so one key's backlog cannot make everyone else's requests 429;
        the total is then bounded by twice the budget.
        """
        total = self.queued_device_ms + req.est_device_ms
        if total <= budget_ms:
            return False
        active = {k for k, q in self.waiting.items() if q}
        active |= {k for k, u in self.usage.items() if u.running_rows} | {req.api_key}
        own = sum(r.est_device_ms for r in self.waiting.get(req.api_key, ())) + req.est_device_ms
        return own > budget_ms / len(active) or total > 2 * budget_ms

    def stop(self, req: Request) -> None:
        """Flag one sample to finish with STOP at the next step boundary (a stop string matched)."""
        req.stop_requested = True

    def cancel(self, req: Request) -> None:
        """Flag `req` and its samples for cancellation at the next step boundary."""
        for r in (req, *req.children):
            r.cancel_requested = True

    # -- one step -----------------------------------------------------------------------------
    def schedule(self, now: float) -> StepPlan:
        """Leave, join and build the next step, preempting when blocks run out.

        Args:
            now: the current time in seconds on the engine's clock.
        Returns:
            The step to run; `plan.events` carries finish events of requests that left.
        """
        plan = StepPlan()
        self._leave(now, plan.events)
        if self.join_wait_s(now) == 0.0:
            self._join(now, plan)
        self._build(plan)
        return plan

    # -- batch formation (config.batching) ----------------------------------------------------
    # join_wait_s(now): seconds until the batching policy lets queued requests join (rows and
    # blocks permitting): 0.0 now, math.inf not before the running batch ends or more arrive.
    # A virtual-time driver jumps its clock by it when a step ran nothing.
    def _join_wait_continuous(self, now: float) -> float:
        """Continuous batching: requests join between any two steps."""
        return 0.0

    def _join_wait_static(self, now: float) -> float:
        """Static batching: a new batch forms only when none runs and `max_rows` requests wait."""
        if self.running or self.queue_depth < self.config.max_rows:
            return math.inf
        return 0.0

    def _join_wait_dynamic(self, now: float) -> float:
        """Dynamic batching: as static, but a batch also fires once the oldest waiting request
        has waited `dynamic_window_s`."""
        if self.running or not self.queue_depth:
            return math.inf
        if self.queue_depth >= self.config.max_rows:
            return 0.0
        oldest = min(r.arrival_s for q in self.waiting.values() for r in q)
        wait = oldest + self.config.dynamic_window_s - now
        return 0.0 if wait <= 1e-9 else wait

    def update(self, plan: StepPlan, sampled: SampledTokens, now: float) -> list[TokenEvent]:
        """Advance every request of `plan` by its computed tokens and append sampled tokens.

        Args:
            plan: the plan that was executed.
            sampled: one token per sampling segment, in order.
            now: time in seconds when sampling ended (TTFT ends here for first tokens).
        Returns:
            The events to push: plan.events first, then one per sampled token.
        """
        events = list(plan.events)
        i = 0
        for seg in plan.segments:
            req = seg.request
            draws = seg.sample_requests
            tokens = sampled.token_ids[i:i + len(draws)]
            logprobs = (sampled.logprobs[i:i + len(draws)] if sampled.logprobs is not None
                        else [None] * len(draws))
            tops = (sampled.top_logprobs[i:i + len(draws)] if sampled.top_logprobs is not None
                    else [()] * len(draws))
            i += len(draws)
            if req.finished or req.state == RequestState.PREEMPTED:
                continue
            if req.cancel_requested:
                req.steps_after_cancel += 1
            usage = self.usage[req.api_key]
            if req.state == RequestState.PREFILL:
                usage.weighted_tokens_served += seg.length
            req.num_computed = seg.end
            if req.state == RequestState.PREFILL and req.num_computed >= req.num_prompt:
                req.state = RequestState.DECODE
            if not tokens:
                continue
            if req.cancel_requested:
                self.num_cancelled_tokens += len(tokens)
                self._finish(req, FinishReason.CANCELLED, "cancelled", now, events)
                continue
            if req.stop_requested:          # a stop string matched: this token is past it
                self._finish(req, FinishReason.STOP, "stop string", now, events)
                continue
            if req.forks_now:
                for child in req.children:
                    self._activate_fork(req, child)
            for r, token, logprob, top in zip(draws, tokens, logprobs, tops):
                self._accept(r, token, logprob, tuple(top), now, events)
        return events

    def _activate_fork(self, parent: Request, child: Request) -> None:
        """Start sample `child` on the parent's prefilled prompt blocks (ref_count + 1 each)."""
        self.pool.share(parent.request_id, child.request_id, parent.num_prompt)
        child.num_computed = parent.num_prompt
        child.state = RequestState.DECODE
        child.admitted_s = parent.admitted_s
        self.running.append(child)
        self.by_id[child.request_id] = child
        self.usage[child.api_key].running_rows += 1

    def _accept(self, req: Request, token: int, logprob: float | None,
                top: tuple[tuple[int, float], ...], now: float, events: list[TokenEvent]) -> None:
        """Append a sampled token to `req`, emit its event, finish it on EOS or length."""
        req.generated.append(token)
        self.usage[req.api_key].weighted_tokens_served += self.config.output_token_weight
        if req.first_token_s is None:
            req.first_token_s = now
        else:
            req.max_gap_s = max(req.max_gap_s, now - req.last_token_s)
        req.last_token_s = now
        reason = self._stop_reason(req, token)
        if reason is None:
            events.append(TokenEvent(req.group_id, index=req.index, token_id=token, logprob=logprob,
                                     top_logprobs=top, position=len(req.generated) - 1))
        else:
            self._finish(req, reason, "", now, events, token=token, logprob=logprob, top=top)

    def fail_all(self, now: float, detail: str) -> list[TokenEvent]:
        """End every queued and running request with FinishReason.ERROR (the loop failed)."""
        events: list[TokenEvent] = []
        for req in list(self.running) + [r for q in self.waiting.values() for r in q]:
            self._finish(req, FinishReason.ERROR, detail, now, events)
        return events

    # -- queries ------------------------------------------------------------------------------
    @property
    def queue_depth(self) -> int:
        """Requests waiting to be admitted (including preempted ones)."""
        return sum(len(q) for q in self.waiting.values())

    @property
    def has_work(self) -> bool:
        """True while any request is queued or running."""
        return bool(self.running) or self.queue_depth > 0

    def stats(self) -> SchedulerStats:
        """Gauges and counters for /metrics (call under the engine lock)."""
        return SchedulerStats(
            queue_depth=self.queue_depth, queued_device_s=self.queued_device_ms / 1000.0,
            running_rows=len(self.running), kv_blocks_free=self.pool.num_free,
            kv_blocks_total=self.pool.num_blocks, num_preemptions=self.num_preemptions,
            num_cancelled_tokens=self.num_cancelled_tokens, num_rejected=self.num_rejected,
            num_finished=self.num_finished)

    # -- internals ----------------------------------------------------------------------------
    def _stop_reason(self, req: Request, token: int) -> FinishReason | None:
        if token == req.eos_token_id and not req.sampling.ignore_eos:
            return FinishReason.STOP
        if len(req.generated) >= req.max_tokens or req.num_tokens >= self.config.max_context:
            return FinishReason.LENGTH
        return None

    def _leave(self, now: float, events: list[TokenEvent]) -> None:
        """Leave: drop stopped, cancelled and expired rows and queued requests."""
        for req in list(self.running) + [r for q in self.waiting.values() for r in q]:
            if req.stop_requested:
                self._finish(req, FinishReason.STOP, "stop string", now, events)
            elif req.cancel_requested or now >= req.deadline_s:
                detail = "cancelled" if req.cancel_requested else "deadline"
                self._finish(req, FinishReason.CANCELLED, detail, now, events)

    def _join(self, now: float, plan: StepPlan) -> None:
        """Join: admit from the least-served key while rows and blocks allow.

        When the least-served key's next request does not fit and another key holds more than
        `per_key_rows` rows, that key's newest row is preempted: a key may use more than its cap
        only while no other key is waiting for room.
        """
        while True:
            req = self._next_candidate()
            if req is None:
                return
            if self._fits(req):
                self._admit(req, now)
                continue
            over = [k for k, u in self.usage.items()
                    if k != req.api_key and u.running_rows > self.config.per_key_rows]
            if not over or self.usage[req.api_key].running_rows >= self.config.per_key_rows:
                return          # wait for rows/blocks; never skip ahead to a smaller request
            key = max(over, key=lambda k: self.usage[k].running_rows)
            victim = next(r for r in reversed(self.running) if r.api_key == key)
            self._preempt(victim, plan)

    def _fits(self, req: Request) -> bool:
        """Rows and blocks allow `req` now (free blocks cover its prompt plus the margin)."""
        pending_forks = sum(len(r.children) for r in self.running if r.forks_now)
        if len(self.running) + pending_forks + req.n > self.config.max_rows:
            return False
        need = self.config.blocks_for(req.num_prompt)
        reserved = sum(self.pool.blocks_needed(r.request_id, r.num_prompt)
                       for r in self.running if r.state == RequestState.PREFILL)
        free = self.pool.num_free - reserved
        return free >= need + self.margin_blocks or (not self.running and free >= need)

    def _admit(self, req: Request, now: float) -> None:
        self.waiting[req.api_key].popleft()
        self.queued_device_ms = max(0.0, self.queued_device_ms - req.est_device_ms)
        req.state = RequestState.PREFILL
        req.num_computed = 0
        if req.admitted_s is None:
            req.admitted_s = now
        self.usage[req.api_key].running_rows += 1
        self.running.append(req)

    def _next_candidate(self) -> Request | None:
        """Head of the least-served waiting key; keys under the row cap first (work-conserving:
        when every waiting key is at its cap, the least-served one still gets the free row).
        Ties go to the key with fewer rows, then to the older head request."""
        keys = [k for k, q in self.waiting.items() if q]
        if not keys:
            return None
        under = [k for k in keys if self.usage[k].running_rows < self.config.per_key_rows]
        key = min(under or keys, key=lambda k: (self.usage[k].weighted_tokens_served,
                                                self.usage[k].running_rows, self.waiting[k][0].arrival_s))
        return self.waiting[key][0]

    def _build(self, plan: StepPlan) -> None:
        """Build: one token per decoding row, then prefill pieces within the budget
        (no budget unless `config.batching` is "continuous": whole prompts in one step).

        Prefill goes to the least-served key first (at a tie, to the request with less of its
        prompt done, then admission order), several requests share a step, and each request is
        cut on the `prefill_piece` grid.
        """
        for req in list(self.running):
            if req.state != RequestState.DECODE or req not in self.running:
                continue
            if not self._reserve(req, req.num_computed, req.num_computed + 1, plan):
                continue
            samples = req.num_computed + 1 == req.num_tokens
            plan.segments.append(Segment(req, req.num_computed, 1, samples,
                                         tuple(self.pool.table(req.request_id)), decode=True))
        cfg = self.config
        budget = (cfg.prefill_chunk_few_rows if plan.num_decode_rows <= cfg.few_rows
                  else cfg.prefill_chunk) if self._chunked_prefill else math.inf
        piece = cfg.prefill_piece
        prefilling = sorted((r for r in self.running if r.state == RequestState.PREFILL),
                            key=lambda r: (self.usage[r.api_key].weighted_tokens_served,
                                           r.num_computed))
        for req in prefilling:
            pos = req.num_computed
            while pos < req.num_prompt and req in self.running:
                length = min(req.num_prompt - pos, piece - pos % piece)
                if length > budget or not self._reserve(req, pos, pos + length, plan):
                    break
                plan.segments.append(Segment(req, pos, length, pos + length == req.num_tokens,
                                             tuple(self.pool.table(req.request_id))))
                pos += length
                budget -= length

    def _reserve(self, req: Request, pos: int, num_tokens: int, plan: StepPlan) -> bool:
        """Give `req` blocks for `num_tokens` positions (writing from `pos`), preempting newer
        requests if needed. Returns False when `req` itself had to be preempted (it was newest).
        """
        rid = req.request_id
        while not self.pool.can_allocate(self.pool.blocks_needed(rid, num_tokens)
                                         + self.pool.is_shared(rid, pos)):
            victim = self.running[-1]
            self._preempt(victim, plan)
            if victim is req:
                return False
        if self.pool.is_shared(rid, pos):      # first write into a shared partial prompt block
            plan.block_copies.append(self.pool.copy_on_write(rid, pos))
        self.pool.ensure_capacity(rid, num_tokens)
        return True

    def _preempt(self, req: Request, plan: StepPlan) -> None:
        """Preempt: free the newest request's blocks and queue it first for its key."""
        own = set(self.pool.table(req.request_id))
        plan.block_copies[:] = [(s, d) for s, d in plan.block_copies if d not in own]
        self.pool.free(req.request_id)
        self.running.remove(req)
        plan.segments[:] = [s for s in plan.segments if s.request is not req]
        self.usage[req.api_key].running_rows -= 1
        req.state = RequestState.PREEMPTED
        req.num_computed = 0
        self.waiting.setdefault(req.api_key, deque()).appendleft(req)
        self.queued_device_ms += req.est_device_ms
        self.num_preemptions += 1
        plan.num_preempted += 1

    def _finish(self, req: Request, reason: FinishReason, detail: str, now: float,
                events: list[TokenEvent], token: int | None = None,
                logprob: float | None = None, top: tuple[tuple[int, float], ...] = ()) -> None:
        """Remove `req` from the engine, return its blocks and emit its last event.

        Samples not yet forked from `req` end with it (same reason), each with its own event.
        """
        if req in self.running:
            self.running.remove(req)
            self.usage[req.api_key].running_rows -= 1
        else:
            queue = self.waiting.get(req.api_key)
            if queue is not None and req in queue:
                queue.remove(req)
                self.queued_device_ms = max(0.0, self.queued_device_ms - req.est_device_ms)
        self.pool.free(req.request_id)
        self.by_id.pop(req.request_id, None)
        req.state = RequestState.CANCELLED if reason == FinishReason.CANCELLED else RequestState.DONE
        req.finish_reason, req.finish_detail, req.finished_s = reason, detail, now
        self.num_finished += 1
        if reason != FinishReason.CANCELLED:
            self.avg_output_tokens = 0.9 * self.avg_output_tokens + 0.1 * len(req.generated)
        ms = lambda t: None if t is None else (t - req.arrival_s) * 1000.0  # noqa: E731
        n = len(req.generated)
        tpot_ms = None
        if n > 1 and req.first_token_s is not None and req.last_token_s is not None:
            tpot_ms = (req.last_token_s - req.first_token_s) * 1000.0 / (n - 1)
        events.append(TokenEvent(
            req.group_id, index=req.index, token_id=token, logprob=logprob, top_logprobs=top,
            position=max(0, len(req.generated) - 1), finish_reason=reason, finish_detail=detail,
            num_prompt_tokens=req.num_prompt, num_completion_tokens=len(req.generated),
            queue_ms=ms(req.admitted_s) if req.admitted_s is not None else ms(now),
            ttft_ms=ms(req.first_token_s), e2e_ms=ms(now), tpot_ms=tpot_ms,
            max_gap_ms=req.max_gap_s * 1000.0, steps_after_cancel=req.steps_after_cancel))
        if req.forks_now:
            for child in req.children:
                if not child.finished:
                    child.steps_after_cancel = req.steps_after_cancel
                    self._finish(child, reason, detail, now, events)
