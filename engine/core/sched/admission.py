"""Admission control (the admit step): refuse a request with a 429 when the queueing delay it
would see passes the budget.

The delay is estimated in device time: the estimates (`Request.est_device_ms`) of the queued
requests that would wait ahead of it for rows or KV blocks, itself included (`waiting_work_ms`),
plus the prompt tokens that running rows have still to prefill before its own prompt's turn
(`prefill_backlog_ms`): under chunked prefill a request usually joins the running batch at once,
and what it then waits for is those prompts. When every row is taken and its key holds rows up to
its cap or more, the time until enough running rows leave to seat the waiting requests and it
(`row_wait_ms`) counts instead where it is longer.
Over the budget a key whose own waiting work is within its fair share is still admitted
(`over_budget`). docs/scheduling.md, "Admission and fairness".

`waiting_work_ms` replays the join's order and room on a tally of its own, not the join's
predicates: it is an estimate, and it differs from `Scheduler._fits` on purpose (see its
docstring). Pure arithmetic: no clock, no tensors, nothing changed but `num_rejected`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.core.block_pool import BlockPool
from engine.core.cost_model import CostModel, StepFeatures
from engine.core.request import Request
from engine.core.sched.fair_queue import FairQueue

__all__ = ["AdmissionControl", "AdmissionRejected", "WaitingWork", "row_free_ms"]


class AdmissionRejected(Exception):
    """More device work is queued than the budget allows (HTTP 429).

    Attributes:
        retry_after_s: whole seconds after which the queue should have drained enough (>= 1).
    """

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(frozen=True, slots=True)
class WaitingWork:
    """What a request would wait for if queued now (`AdmissionControl.waiting_work_ms`).

    Attributes:
        total_ms: device time of the queued work that waits ahead of it, itself included when it
            waits too, all keys', ms.
        own_ms: the part of `total_ms` of its own key, ms.
        rows_short: rows that the waiting requests up to and including it need beyond those
            free now (0 when it would join at the next step).
        own_rows_short: the same for its own key's waiting requests alone (the rows it waits
            for when the fair queue seats its key first).
        key_rows: rows its key holds once the requests the replay seats ahead of it have joined
            (running rows, plus those joins).
    """

    total_ms: float
    own_ms: float
    rows_short: int
    own_rows_short: int
    key_rows: int


class AdmissionControl:
    """The queue budget (`config.queue_budget_s`) and the count of requests it refused.

    Args:
        config: the engine's dials (`queue_budget_s`, `per_key_rows`, `max_rows`, block size).
        pool: the block pool whose free blocks the estimate counts.
        margin_blocks: blocks the join keeps free (`free_margin` of the pool).
        joins_between_steps: requests join a running batch (continuous batching); False under
            static and dynamic batching, where every queued request waits.

    Attributes:
        num_rejected: requests refused so far.
    """

    def __init__(self, config: EngineConfig, pool: BlockPool, margin_blocks: int,
                 joins_between_steps: bool, step_tokens: int | None = None) -> None:
        self.config = config
        # a request's prompt tokens per step (`StepBudget.request_step_tokens`), for the blocks
        # a sliding-window KV group holds while it prefills
        self.step_tokens = step_tokens if step_tokens is not None else config.prefill_step_tokens
        self.pool = pool
        self.margin_blocks = margin_blocks
        self.joins_between_steps = joins_between_steps
        self.num_rejected = 0

    def check(self, req: Request, queue: FairQueue, running: Sequence[Request], rows: int,
              prefill_ms: Callable[[int], float],
              row_free_ms: Callable[[], Sequence[float]] | None = None,
              is_aged: Callable[[Request, float], bool] | None = None) -> None:
        """Refuse `req` when queueing it now passes the budget (call only while something is
        queued or a running row is still prefilling: with neither, a request always gets in, so
        one large request is never refused forever; its own work never counts against it unless
        it has to wait for rows or blocks).

        The wait for running rows to leave (`row_wait_ms`) counts only under continuous batching
        and only when `req`'s key holds min(`per_key_rows`, `rows`) rows or more, counting the
        queued ones the replay seats ahead of it (`WaitingWork.key_rows`): then it is the key
        filling the batch and waits behind its own rows. A lighter key is seated by the join
        before it (or by preempting an over-cap key), so another key's full rows never refuse
        it; that leaves many keys each under the cap filling every row uncounted. The request
        waits at least the row wait and at least the queued work plus the prefill backlog, so
        the larger of the two counts.

        Args:
            req: the request, its `est_device_ms` set.
            queue: the waiting requests and the keys' accounts.
            running: the running requests, oldest first.
            rows: the rows a join may fill (`StepBudget.queue_rows`).
            prefill_ms: device time of prefilling n prompt tokens, ms (`CostModel.prefill_ms`).
            row_free_ms: returns when each running row is expected to leave, ms from now,
                ascending (`row_free_ms`); called only when the row wait counts.
                None: no row-wait term.
            is_aged: whether a running prompt goes ahead of its key's later ones by age at a
                time (s) (`StepBudget.is_aged`), for `prefill_backlog_ms`; None: never.
        Raises:
            AdmissionRejected: over budget; `retry_after_s` is the excess in whole seconds (the
                device drains one device-second of waiting work per second), at least 1.
        """
        budget_ms = self.config.queue_budget_s * 1000.0
        work = self.waiting_work_ms(req, queue, running, rows)
        backlog, own_backlog = self.prefill_backlog_ms(req, running, prefill_ms, is_aged)
        total = work.total_ms + backlog
        own = work.own_ms + own_backlog
        row_wait = 0.0
        if (row_free_ms is not None and self.joins_between_steps and work.rows_short
                and work.key_rows >= min(self.config.per_key_rows, rows)):
            free = row_free_ms()
            row_wait = self.row_wait_ms(work.rows_short, free)
            total = max(total, row_wait)
            own = max(own, self.row_wait_ms(work.own_rows_short, free))
        if self.over_budget(req, total, own, budget_ms, queue):
            self.num_rejected += 1
            excess_ms = total - budget_ms
            raise AdmissionRejected(
                f"queueing this request makes {total / 1000:.2f} s of waiting "
                f"({backlog / 1000:.2f} s of running prompts not yet prefilled ahead of it, "
                f"{work.total_ms / 1000:.2f} s queued for rows or KV blocks, itself included when it "
                f"waits too; {row_wait / 1000:.2f} s until running rows leave to seat it), "
                f"budget {self.config.queue_budget_s:g} s",
                max(1, math.ceil(excess_ms / 1000.0)))

    @staticmethod
    def row_wait_ms(rows_short: int, row_free_ms: Sequence[float]) -> float:
        """Time until `rows_short` more rows are free, ms: the `rows_short`-th of `row_free_ms`
        (each running row's expected leaving time, ascending). Past the last running row, the
        rows that later joiners take are assumed to turn over as slowly as the slowest of these,
        once per round of `len(row_free_ms)` rows. 0.0 with no rows short or none running.
        """
        if rows_short <= 0 or not row_free_ms:
            return 0.0
        rounds, index = divmod(rows_short - 1, len(row_free_ms))
        return row_free_ms[index] + rounds * row_free_ms[-1]

    @staticmethod
    def prefill_backlog_ms(req: Request, running: Sequence[Request], prefill_ms: Callable[[int], float],
                           is_aged: Callable[[Request, float], bool] | None = None) -> tuple[float, float]:
        """Device time of the prompt tokens running rows have still to prefill before `req`'s
        prompt would get its turn, ms: (all keys', `req`'s key's).

        Steps fill with the prompt that has the fewest tokens left first
        (`StepBudget.prefill_tiebreak`), so a running prompt with no more tokens left than all of
        `req`'s prompt goes ahead of it and counts whole; a longer one would be passed over and
        counts nothing, unless it is `req`'s key's and `is_aged(r, req.stats.arrival_s)` (in the batch
        long enough, `StepBudget.is_aged`): then it goes ahead of the key's later prompts and
        counts whole too (another key's aged prompt goes first only when that key is not more
        served, which is the fair-share order this estimate ignores). An estimate: it ignores the keys'
        fair-share order (which puts a less served key's prompts first), the prefix cache's
        credit on `req`'s prompt, the decode rows' share of every step, prompts that arrive later
        and are shorter, and longer ones that age while `req` waits.
        """
        total = own = 0.0
        for r in running:
            left = r.num_prompt - r.num_computed
            aged = is_aged is not None and r.api_key == req.api_key and is_aged(r, req.stats.arrival_s)
            if r.is_prefilling and (left <= req.num_prompt or aged):
                ms = prefill_ms(left)
                total += ms
                if r.api_key == req.api_key:
                    own += ms
        return total, own

    def waiting_work_ms(self, req: Request, queue: FairQueue, running: Sequence[Request],
                        rows: int) -> WaitingWork:
        """The queueing delay `req` would see if queued now, as device-ms of work that waits ahead
        of it, itself included (all keys', `req`'s key's), and the rows those waiting requests
        need beyond the free ones.

        Under continuous batching the queued requests and `req` are taken in the join's order
        (keys under `per_key_rows` first, then the least-served key, then arrival; a key that
        becomes active starts level with the least-served active one). One that the next join
        would admit waits for nothing and counts nothing: a free row and its prompt's blocks plus
        the free margin, or room the join makes by preempting a key over `per_key_rows`. From the
        first one that does not fit on, everything waits (join never skips ahead) and counts its
        estimate, up to `req`. Under static and dynamic batching all queued work and `req`'s count.

        Where it differs from the join's own check (`Scheduler._fits`), on purpose: it sorts by
        (over the cap, served, `req` last among equals, arrival), not `next_candidate`'s (served,
        rows, head's arrival) per key; it counts a prompt's whole blocks, with no credit for
        cached prefix blocks; it keeps the margin even when nothing runs; and room made by
        preemption leaves the preempted key's rows and blocks in its tally.
        """
        cfg = self.config
        rows_of = {k: u.running_rows for k, u in queue.usage.items() if u.running_rows}
        active = [u.weighted_tokens_served for k, u in queue.usage.items()
                  if u.running_rows or queue.waiting.get(k)]
        floor = min(active, default=0.0)

        def served(key: str) -> float:
            """`key`'s weighted tokens served, an inactive key's raised to the active floor."""
            u = queue.usage.get(key)
            if u is None or not (u.running_rows or queue.waiting.get(key)):
                return max(floor, u.weighted_tokens_served if u is not None else 0.0)
            return u.weighted_tokens_served

        order = sorted((*queue.requests(), req),
                       key=lambda r: (rows_of.get(r.api_key, 0) >= cfg.per_key_rows, served(r.api_key),
                                      r is req, r.stats.arrival_s))
        total = own = 0.0
        blocked = not self.joins_between_steps
        pending_forks = sum(len(r.children) for r in running if r.forks_now)
        rows_free = rows - len(running) - pending_forks
        step = self.step_tokens
        reserved = sum(self.pool.blocks_to_compute(r.request_id, r.num_prompt, step)
                       for r in running if r.is_prefilling)
        blocks_free = self.pool.num_free - reserved - self.margin_blocks
        waiting_rows = own_rows = 0
        for r in order:
            need = self.pool.blocks_to_compute(None, r.num_prompt, step)
            key = r.api_key
            if not blocked and r.n <= rows_free and need <= blocks_free:
                rows_free -= r.n
                blocks_free -= need
                rows_of[key] = rows_of.get(key, 0) + r.n
            elif not blocked and rows_of.get(key, 0) < cfg.per_key_rows and any(
                    n > cfg.per_key_rows for k, n in rows_of.items() if k != key):
                rows_of[key] = rows_of.get(key, 0) + r.n      # the join preempts an over-cap key
            else:
                blocked = True
                total += r.est_device_ms
                waiting_rows += r.n
                if key == req.api_key:
                    own += r.est_device_ms
                    own_rows += r.n
            if r is req:
                break
        # rows_free < 0 when pending forks already need more rows than are free
        return WaitingWork(total, own, max(0, waiting_rows - rows_free), max(0, own_rows - rows_free),
                           rows_of.get(req.api_key, 0))

    def over_budget(self, req: Request, total: float, own: float, budget_ms: float,
                    queue: FairQueue) -> bool:
        """Whether queueing `req` passes the budget, with a fair share per key.

        `total` and `own` are the waiting work with `req`, all keys' and `req`'s key's (`check`),
        and `budget_ms` the budget, ms. Over the budget, a key whose own
        waiting work stays within budget / active keys is still admitted, so one key's backlog
        cannot make everyone else's requests 429; the total is then bounded by twice the budget.
        """
        if total <= budget_ms:
            return False
        return own > budget_ms / len(queue.active_keys(req.api_key)) or total > 2 * budget_ms


def row_free_ms(running: Sequence[Request], cost: CostModel, average_answer: float,
                prefill_token_budget: int) -> list[float]:
    """When each running row is expected to leave, ms from now, ascending (`row_wait_ms`'s input).

    A row's tokens still to come are min(max_tokens, `average_answer`) less those it has (at
    least 1), plus one step per `prefill_token_budget` tokens of its prompt still to prefill;
    each costs the cost model's step of the running batch (its rows, their contexts, no
    prefill). An estimate that errs toward admitting: a row already past the average answer is
    taken to leave at the next step.
    """
    if not running:
        return []
    step = cost.step_ms(StepFeatures(rows=len(running), context=sum(r.num_tokens for r in running)))
    left = []
    for r in running:
        tokens = max(1.0, min(r.max_tokens, average_answer) - len(r.generated))
        if r.is_prefilling:
            tokens += math.ceil((r.num_prompt - r.num_computed) / prefill_token_budget)
        left.append(tokens * step)
    return sorted(left)
