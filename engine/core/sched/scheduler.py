"""The scheduler: each step's leave, join, build and preempt, and the bookkeeping after it.

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
(the batch-invariance test of docs/design.md). A preempted request re-prefills its prompt in the
same pieces, then replays the tokens it had already produced as one-token rows without sampling,
so its cache — and its later tokens — are bit-identical to a run without preemption.

`Scheduler` composes one policy per module and keeps the running batch itself:

* `fair_queue.FairQueue`: the waiting requests per API key, the keys' usage accounts, which
  request joins next;
* `admission.AdmissionControl`: the queue budget (429);
* `step_budget.StepBudget`: the rows that fit, each step's prefill budget (the design's token
  caps, and beyond them the time the TPOT and gap targets leave) and the order prompts fill it;
* `batching`: when requests may join (continuous, static, dynamic) and whether prompts are cut;
* `lora_cap.LoraCap`: at most `max_loras` distinct LoRA adapters in a step (the join holds it);
* `engine.core.kv_cache_manager.KVCacheManager`: what a request takes from the prefix cache and
  what it offers back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.core.block_pool import BlockPool
from engine.core.cost_model import CostModel
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.outputs import FinishReason, PromptLogprobs, SampledTokens, TokenEvent
from engine.core.plan import Lifecycle, LifecycleEvent, Segment, StepPlan
from engine.core.request import Request, RequestState, final_event
from engine.core.sched.admission import AdmissionControl, row_free_ms
from engine.core.sched.batching import batching_for
from engine.core.sched.fair_queue import FairQueue
from engine.core.sched.lora_cap import LoraCap
from engine.core.sched.step_budget import RequestAverages, StepBudget

__all__ = ["Scheduler", "SchedulerStats"]


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
    kv_blocks_cached: int = 0
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0


class Scheduler:
    """Decides, step by step, which tokens of which requests the device computes.

    Args:
        config: the engine's dials (row cap, prefill budget, margins, fairness weights, budget).
        pool: the block pool whose free list bounds admission.
        cost: per-token device costs for admission control, the queue estimate and the step's
            prefill budget (None: the design's, `CostModel()`). May be replaced later (`cost = ...`).

    Attributes:
        running: running requests (samples included), in admission order: oldest first.
        by_id: request id → every queued or running request, samples included.
        queue, admission, budget, batching, kv_cache, lora_cap, averages: the composed policies
            (see the module docstring); `averages` is the average request the estimates assume.
        margin_blocks: blocks the join keeps free (`free_margin` of the pool).

    Thread-safety: none. The engine loop serialises every call behind its own lock.
    """

    def __init__(self, config: EngineConfig, pool: BlockPool, cost: CostModel | None = None) -> None:
        self.config = config
        self.pool = pool
        self.cost = cost or CostModel()
        self.running: list[Request] = []
        self.by_id: dict[str, Request] = {}
        self.queue = FairQueue(config.per_key_rows)
        self.kv_cache = KVCacheManager(pool, config.prefix_cache_scope)
        self.averages = RequestAverages()
        self.margin_blocks = math.ceil(config.free_margin * pool.num_blocks)
        self.batching = batching_for(config)
        self.lora_cap = LoraCap(config.max_loras)
        self.budget = StepBudget(config, self.batching.chunked_prefill)
        self.admission = AdmissionControl(config, pool, self.margin_blocks,
                                          self.batching.joins_between_steps,
                                          self.budget.request_step_tokens())
        self.num_preemptions = 0
        self.num_cancelled_tokens = 0
        self.num_finished = 0

    # -- submission ---------------------------------------------------------------------------
    def add(self, req: Request, now: float) -> None:
        """Queue `req` under its API key, or reject it when the queue is over budget.

        Its device-time estimate (`est_device_ms`) charges the prompt tokens not already in the
        prefix cache and min(max_tokens, the average answer) tokens per sample at
        `StepBudget.full_rows`.

        Raises:
            AdmissionRejected: the queueing delay this request would see, in device-seconds of
                work ahead that waits for rows or blocks (`AdmissionControl.waiting_work_ms`,
                with its own estimate when it would wait too) and of running prompts not yet
                prefilled that go before it (`AdmissionControl.prefill_backlog_ms`), or, for a
                key holding min(`per_key_rows`, `max_rows`) rows or more (its queued requests
                that join first included) while every row is taken, in seconds until running
                rows leave to seat it (`AdmissionControl.row_wait_ms`), passes
                `config.queue_budget_s` (only while something else is queued or prefilling).
            ValueError: a request with the same id is already in the engine.
        """
        if req.request_id in self.by_id:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        expected = min(req.max_tokens, self.averages.output_tokens) * req.n
        to_compute = req.num_prompt - self.kv_cache.num_cached_tokens(req, self.config.prefill_piece)
        req.est_device_ms = self.cost.estimate_ms(to_compute, expected, self.budget.full_rows())
        self.averages.observe_prompt(req.num_prompt)
        for child in req.children:
            child.stats.arrival_s, child.deadline_s = req.stats.arrival_s, req.deadline_s
        if self.queue.depth or any(r.is_prefilling for r in self.running):
            rows = self.budget.queue_rows()
            self.admission.check(req, self.queue, self.running, rows, self.cost.prefill_ms,
                                 lambda: row_free_ms(self.running, self.cost, self.averages.output_tokens,
                                                     self.config.prefill_token_budget),
                                 self.budget.is_aged)
        req.state = RequestState.QUEUED
        self.queue.enqueue(req)
        self.by_id[req.request_id] = req

    def stop(self, req: Request) -> None:
        """Flag one sample to finish with STOP at the next step boundary (a stop string matched)."""
        req.stop_requested = True

    def cancel(self, req: Request) -> None:
        """Flag `req` and its samples for cancellation at the next step boundary."""
        for r in (req, *req.children):
            r.cancel_requested = True

    def join_wait_s(self, now: float) -> float:
        """Seconds until the batching mode lets queued requests join (rows and blocks
        permitting): 0.0 now, `math.inf` not before the running batch ends or more arrive
        (`batching`). A virtual-time driver jumps its clock by it when a step ran nothing."""
        return self.batching.join_wait_s(now, len(self.running), self.queue)

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
        self._build(plan, now)
        return plan

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
        # by (request, first position): a prompt may run as several pieces in one step
        prompt_logprobs = {(p.request_id, p.first_position): p for p in sampled.prompt_logprobs}
        i = 0
        for seg in plan.segments:
            n = len(seg.sample_requests)
            draws = list(zip(seg.sample_requests, sampled.token_ids[i:i + n],
                             sampled.logprobs[i:i + n] if sampled.logprobs is not None else [None] * n,
                             sampled.top_logprobs[i:i + n] if sampled.top_logprobs is not None else [()] * n))
            i += n
            piece = prompt_logprobs.get((seg.request.request_id, seg.start + 1))
            self._advance(seg, draws, piece, now, events)
        return events

    def _advance(self, seg: Segment, draws: list[tuple[Request, int, float | None, tuple]],
                 piece: PromptLogprobs | None, now: float, events: list[TokenEvent]) -> None:
        """One executed segment: its request's computed tokens (charged to its key, prompt pieces
        offered to the prefix cache, prompt logprobs kept), then its sampled tokens (request,
        token, logprob, top alternatives), unless it was cancelled, stopped or preempted."""
        req = seg.request
        if req.finished or req.state == RequestState.PREEMPTED:
            return
        if req.cancel_requested:
            req.stats.steps_after_cancel += 1
        prefilled = req.is_prefilling           # this segment was a prompt piece
        if prefilled and req.sampling.prompt_logprobs is not None:
            self._record_prompt_logprobs(req, piece)
        if prefilled:
            self.queue.charge(req.api_key, seg.length)
        req.num_computed = seg.end
        if prefilled:
            self.kv_cache.cache_piece(req, seg.start, seg.length, self.config.prefill_piece)
        if not draws:
            return
        if req.cancel_requested:
            self.num_cancelled_tokens += len(draws)
            self._finish(req, FinishReason.CANCELLED, "cancelled", now, events)
            return
        if req.stop_requested:          # a stop string matched: this token is past it
            self._finish(req, FinishReason.STOP, "stop string", now, events)
            return
        if req.forks_now:
            for child in req.children:
                self._activate_fork(req, child)
        if req.prompt_logprob_entries is not None and not req.generated:
            events.append(TokenEvent(req.group_id, index=req.index, prompt_logprobs=tuple(
                entry or (float("nan"), ()) for entry in req.prompt_logprob_entries)))
        for r, token, logprob, top in draws:
            self._accept(r, token, logprob, tuple(top), now, events)

    @staticmethod
    def _record_prompt_logprobs(req: Request, piece: PromptLogprobs | None) -> None:
        """Keep a prefill piece's prompt logprobs on `req` (by position: a piece computed again
        after a preemption overwrites the same entries with the same values)."""
        if req.prompt_logprob_entries is None:
            req.prompt_logprob_entries = [None] * (req.num_prompt - 1)
        if piece is None:
            return
        for k, (lp, top) in enumerate(zip(piece.logprobs, piece.top_logprobs)):
            req.prompt_logprob_entries[piece.first_position - 1 + k] = (lp, tuple(top))

    def fail_all(self, now: float, detail: str) -> list[TokenEvent]:
        """End every queued and running request with FinishReason.ERROR (the loop failed)."""
        events: list[TokenEvent] = []
        for req in list(self.running) + list(self.queue.requests()):
            self._finish(req, FinishReason.ERROR, detail, now, events)
        return events

    # -- queries ------------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        """True while any request is queued or running."""
        return bool(self.running) or self.queue.depth > 0

    def stats(self) -> SchedulerStats:
        """Gauges and counters for /metrics (call under the engine lock)."""
        return SchedulerStats(
            queue_depth=self.queue.depth, queued_device_s=self.queue.queued_device_ms / 1000.0,
            running_rows=len(self.running), kv_blocks_free=self.pool.num_free,
            kv_blocks_total=self.pool.num_usable, num_preemptions=self.num_preemptions,
            num_cancelled_tokens=self.num_cancelled_tokens, num_rejected=self.admission.num_rejected,
            num_finished=self.num_finished, kv_blocks_cached=self.pool.num_cached_unused,
            prefix_queried_tokens=self.kv_cache.prefix_queried_tokens,
            prefix_hit_tokens=self.kv_cache.prefix_hit_tokens)

    # -- leave and join -----------------------------------------------------------------------
    def _leave(self, now: float, events: list[TokenEvent]) -> None:
        """Leave: drop stopped, cancelled and expired rows and queued requests."""
        for req in list(self.running) + list(self.queue.requests()):
            if req.stop_requested:
                self._finish(req, FinishReason.STOP, "stop string", now, events)
            elif req.cancel_requested or now >= req.deadline_s:
                detail = "cancelled" if req.cancel_requested else "deadline"
                self._finish(req, FinishReason.CANCELLED, detail, now, events)

    def _join(self, now: float, plan: StepPlan) -> None:
        """Join: admit from the least-served key while rows, blocks and the step's adapter cap
        allow (`LoraCap.fits`: at most `max_loras` distinct LoRA adapters run, so every step
        the build makes of the running rows has at most that many).

        When the least-served key's next request does not fit and another key holds more than
        `per_key_rows` rows, that key's newest row is preempted: a key may use more than its cap
        only while no other key is waiting for room (`FairQueue.preemptible_key`). A candidate
        that waits for an adapter slot preempts no one and holds back only its own key's queue:
        other keys join past it (base-model rows, running adapters) until it has waited
        `aged_after_s`; then nothing joins and the running adapters' rows end on their own.
        """
        waiting_for_adapter: set[str] = set()
        while True:
            req = self.queue.next_candidate(skip=waiting_for_adapter)
            if req is None:
                return
            if not self.lora_cap.fits(self.running, req):
                if now - req.stats.arrival_s >= self.budget.aged_after_s():
                    return      # drain: a running adapter's rows end and free its slot
                waiting_for_adapter.add(req.api_key)
                continue
            if self._fits(req):
                self._admit(req, now, plan)
                continue
            key = self.queue.preemptible_key(req)
            if key is None:
                return          # wait for rows/blocks; never skip ahead to a smaller request
            victim = next(r for r in reversed(self.running) if r.api_key == key)
            self._preempt(victim, plan, now)

    def _fits(self, req: Request) -> bool:
        """Rows and blocks allow `req` now: the step budget's rows (`StepBudget.rows_fit`), and
        free blocks, less those reserved for running prefills, cover its prompt plus the margin
        (without the margin when nothing runs)."""
        if not self.budget.rows_fit(self.running, req):
            return False
        hits = self.kv_cache.get_computed_blocks(req, self.config.prefill_piece)
        step = self.budget.request_step_tokens()
        # Cached blocks another request holds cost no free block; unused cached ones are
        # counted in num_free and leave it when taken, like any other block.
        need = self.pool.blocks_to_compute(None, req.num_prompt, step) - sum(
            self.pool.ref_count(b) > 0 for table in hits for b in table)
        reserved = sum(self.pool.blocks_to_compute(r.request_id, r.num_prompt, step)
                       for r in self.running if r.is_prefilling)
        free = self.pool.num_free - reserved
        return free >= need + self.margin_blocks or (not self.running and free >= need)

    def _admit(self, req: Request, now: float, plan: StepPlan) -> None:
        """Admit the fair queue's candidate `req`: run it from its cached prefix, if any."""
        self.queue.pop_head(req)
        req.state = RequestState.RUNNING
        blocks = self.kv_cache.get_computed_blocks(req, self.config.prefill_piece)
        req.num_computed = req.stats.num_cached = self.kv_cache.take_computed_blocks(req, blocks)
        plan.lifecycle.append(LifecycleEvent(
            req, Lifecycle.ADMITTED if req.stats.admitted_s is None else Lifecycle.READMITTED, now))
        if req.stats.admitted_s is None:
            req.stats.admitted_s = now
        req.joined_s = now
        self.queue.row_started(req.api_key)
        self.running.append(req)

    # -- build --------------------------------------------------------------------------------
    def _build(self, plan: StepPlan, now: float) -> None:
        """Build: one token per decoding row, then prefill pieces within the step's budget
        (`StepBudget.for_step`: the design's prompt tokens, and more while the step's predicted time
        stays within what its rows can spare; whole prompts when prefill is not chunked).

        Prefill goes to the least-served key first (at a tie, as the budget orders prompts:
        `prefill_tiebreak`), several requests share a step, and each request is cut on the
        `prefill_piece` grid: the budget decides how many pieces run, never where a prompt is
        cut. A piece that does not fit moves on to the next request (`PaceBudget.fits`).
        """
        for req in list(self.running):
            if req.is_prefilling or req not in self.running:
                continue
            if not self._reserve(req, req.num_computed, req.num_computed + 1, plan, now):
                continue
            samples = req.num_computed + 1 == req.num_tokens
            first, *others = self.pool.tables(req.request_id)
            plan.segments.append(Segment(req, req.num_computed, 1, samples, first, decode=True,
                                         group_tables=tuple(others)))
        prefilling = sorted((r for r in self.running if r.is_prefilling),
                            key=lambda r: (self.queue.served(r.api_key), self.budget.prefill_tiebreak(r, now)))
        if not prefilling:
            return
        budget = self.budget.for_step(plan, now, self.cost)
        piece = self.config.prefill_piece
        # A sliding-window group holds its window plus the step's tokens of the request: admission
        # counted `request_step_tokens` of them, so a request's pieces stop there (without the
        # cap a step the cost model allows could need more blocks than the pool has, and a lone
        # request would preempt itself every step).
        cap = self.budget.request_step_tokens() if self.pool.sliding else None
        for req in prefilling:
            pos = req.num_computed
            while pos < req.num_prompt and req in self.running:
                length = min(req.num_prompt - pos, piece - pos % piece)
                if cap is not None and pos + length - req.num_computed > cap:
                    break
                if not budget.fits(pos, length) or not self._reserve(req, pos, pos + length, plan, now):
                    break
                first, *others = self.pool.tables(req.request_id)
                plan.segments.append(Segment(req, pos, length, pos + length == req.num_tokens,
                                             first, group_tables=tuple(others)))
                budget.spend(pos, length)
                pos += length

    def _reserve(self, req: Request, pos: int, num_tokens: int, plan: StepPlan, now: float) -> bool:
        """Give `req` blocks for `num_tokens` positions (writing from `pos`), preempting newer
        requests if needed. Returns False when `req` itself had to be preempted (it was newest).
        Sliding-window groups first give back the blocks no query of this step can see (the
        step computes `req` from `req.num_computed`).
        """
        rid = req.request_id
        self.pool.slide(rid, req.num_computed)
        while not self.pool.can_allocate(self.pool.blocks_needed(rid, num_tokens)
                                         + self.pool.is_shared(rid, pos)):
            victim = self.running[-1]
            self._preempt(victim, plan, now)
            if victim is req:
                return False
        if self.pool.is_shared(rid, pos):      # first write into a shared partial prompt block
            plan.block_copies.extend(self.pool.copy_on_write(rid, pos))
        self.pool.ensure_capacity(rid, num_tokens)
        return True

    def _preempt(self, req: Request, plan: StepPlan, now: float) -> None:
        """Preempt: free `req`'s blocks, drop it from the step and queue it first for its key."""
        own = set(self.pool.held_blocks(req.request_id))
        plan.block_copies[:] = [(s, d) for s, d in plan.block_copies if d not in own]
        self.pool.free(req.request_id)
        self.running.remove(req)
        plan.segments[:] = [s for s in plan.segments if s.request is not req]
        self.queue.row_ended(req.api_key)
        req.state = RequestState.PREEMPTED
        req.num_computed = 0
        self.queue.push_front(req)
        self.num_preemptions += 1
        plan.num_preempted += 1
        plan.lifecycle.append(LifecycleEvent(req, Lifecycle.PREEMPTED, now))

    # -- after the step -----------------------------------------------------------------------
    def _activate_fork(self, parent: Request, child: Request) -> None:
        """Start sample `child` on the parent's prefilled prompt blocks (ref_count + 1 each)."""
        self.pool.share(parent.request_id, child.request_id, parent.num_prompt)
        child.num_computed = parent.num_prompt
        child.state = RequestState.RUNNING
        child.stats.admitted_s = parent.stats.admitted_s
        child.joined_s = parent.joined_s
        self.running.append(child)
        self.by_id[child.request_id] = child
        self.queue.row_started(child.api_key)

    def _accept(self, req: Request, token: int, logprob: float | None,
                top: tuple[tuple[int, float], ...], now: float, events: list[TokenEvent]) -> None:
        """Append a sampled token to `req`, emit its event, finish it on EOS or length."""
        req.generated.append(token)
        self.queue.charge(req.api_key, self.config.output_token_weight)
        stats = req.stats
        if stats.first_token_s is None:
            stats.first_token_s = now
        else:
            stats.max_gap_s = max(stats.max_gap_s, now - stats.last_token_s)
        stats.last_token_s = now
        reason = self._stop_reason(req, token)
        if reason is None:
            events.append(TokenEvent(req.group_id, index=req.index, token_id=token, logprob=logprob,
                                     top_logprobs=top, position=len(req.generated) - 1))
        else:
            self._finish(req, reason, "", now, events, token=token, logprob=logprob, top=top)

    def _stop_reason(self, req: Request, token: int) -> FinishReason | None:
        """STOP on the end-of-sequence token (unless ignored) or one of `stop_token_ids`, once
        `min_tokens` are generated; LENGTH at `max_tokens` or the context limit; else None.

        (The model runner already bans those tokens before `min_tokens`; the check here keeps
        an executor that does not, the simulator's, to the same rule.)"""
        sampling = req.sampling
        if len(req.generated) >= sampling.min_tokens and (
                (token == req.eos_token_id and not sampling.ignore_eos) or token in sampling.stop_token_ids):
            return FinishReason.STOP
        if len(req.generated) >= req.max_tokens or req.num_tokens >= self.config.max_context:
            return FinishReason.LENGTH
        return None

    def _finish(self, req: Request, reason: FinishReason, detail: str, now: float,
                events: list[TokenEvent], token: int | None = None,
                logprob: float | None = None, top: tuple[tuple[int, float], ...] = ()) -> None:
        """Remove `req` from the engine, return its blocks and emit its last event.

        Samples not yet forked from `req` end with it (same reason), each with its own event.
        """
        if req in self.running:
            self.running.remove(req)
            self.queue.row_ended(req.api_key)
        else:
            self.queue.remove(req)
        self.pool.free(req.request_id)
        self.by_id.pop(req.request_id, None)
        req.state = RequestState.CANCELLED if reason == FinishReason.CANCELLED else RequestState.DONE
        req.finish_reason, req.finish_detail, req.stats.finished_s = reason, detail, now
        self.num_finished += 1
        if reason != FinishReason.CANCELLED:
            self.averages.observe_answer(len(req.generated))
        events.append(final_event(req, now, token, logprob, top))
        if req.forks_now:
            for child in req.children:
                if not child.finished:
                    child.stats.steps_after_cancel = req.stats.steps_after_cancel
                    self._finish(child, reason, detail, now, events)
