"""How big a step may be: the rows that fit, its prefill budget, and the order prompts fill it.

One policy (`StepBudget`), the design's caps with the TPOT target's slack spent on prefill:

* rows: at most `max_rows` (with the samples a running request forks at its first token);
* prefill: prompt pieces join a step while either holds
  - the step's prompt tokens stay within the design's token budget (`prefill_token_budget`,
    `prefill_token_budget_few_rows` with at most `few_rows` decode rows): the floor, so a host
    whose steps are slower than the cost model's targets still prefills at the design's rate;
  - the cost model predicts the step within the time its sampling rows can spare
    (`StepBudget.step_limit_ms`): each row may wait as long as keeps its mean time per output
    token within `tpot_target_ms` and its gap within `gap_target_ms`. Rows that decode faster
    than the target bank the difference, and the bank is spent on prompts' prefill, which is
    what turns the TPOT headroom into time to first token;
* order: at equal service of their keys, the prompt with the fewest tokens left to prefill first,
  except that a prompt which has been prefilling for `AGED_AFTER_BUDGETS` queue budgets goes
  ahead of the prompts that joined after it (earliest joined first among such), so a long
  prompt cannot be passed over by shorter newcomers for ever.

With prefill not chunked (`batching` other than "continuous") a step takes whole prompts and
the token and time budgets do not apply. Either way the budget decides how many pieces run,
never where a prompt is cut: the scheduler cuts every prompt on the `prefill_piece` grid and
asks, piece by piece, whether the next one still fits (`PaceBudget.fits`). Pure arithmetic over
the cost model: no clock (time is an argument), no tensors.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.core.cost_model import CostModel, StepFeatures
from engine.core.plan import StepPlan
from engine.core.request import Request

__all__ = ["AGED_AFTER_BUDGETS", "PaceBudget", "RequestAverages", "StepBudget"]

AGED_AFTER_BUDGETS = 2.0
"""A prompt that has been prefilling (in the running batch, from its latest admission) for this
many queue budgets (`EngineConfig.queue_budget_s`) goes ahead of its key's prompts that joined
later. Admission keeps the prefill waiting ahead of a new prompt within the budget (twice that
for a key within its fair share, `AdmissionControl.over_budget`), so a prompt still unfinished
after twice the budget has been passed over by shorter prompts that joined after it. Past the
knee shortest-first alone let such prompts wait 13–17 s in the simulator (1,000–2,000-token
prompts at 1–1.5 req/s); benchmarks/results/goodput/runs.md, run 20, has what the bound changes."""


@dataclass(slots=True)
class RequestAverages:
    """The average request the estimates assume: exponential moving averages (weight 0.1 on the
    newest) of prompt and answer lengths, tokens. Starts at the design's averages (docs/design.md:
    a 1,250-token prompt, a 300-token answer).

    Attributes:
        prompt_tokens: average prompt length, updated at every submission.
        output_tokens: average answer length, updated at every finish that is not a cancellation.
    """

    prompt_tokens: float = 1250.0
    output_tokens: float = 300.0

    def observe_prompt(self, num_prompt: int) -> None:
        """Fold a submitted request's prompt length (tokens) into the average."""
        self.prompt_tokens = 0.9 * self.prompt_tokens + 0.1 * num_prompt

    def observe_answer(self, num_generated: int) -> None:
        """Fold a finished request's answer length (tokens) into the average."""
        self.output_tokens = 0.9 * self.output_tokens + 0.1 * num_generated


def rows_with(running: Sequence[Request], req: Request) -> int:
    """Rows of the next step if `req` joined: the running rows, the samples they fork at their
    first token, and `req`'s samples."""
    pending_forks = sum(len(r.children) for r in running if r.forks_now)
    return len(running) + pending_forks + req.n


class PaceBudget:
    """A step's prefill budget, consumed piece by piece while the step is built: a piece fits
    while the step's prompt tokens stay within `floor_tokens`, or while the cost model predicts
    the step with it within `limit_ms`.

    Args:
        floor_tokens: prompt tokens the step may carry whatever the prediction (`math.inf`:
            whole prompts, prefill not chunked).
        features: the step so far (its decode rows), for the prediction.
        limit_ms: the longest the step may be predicted to take, ms.
        cost: the cost model that predicts it.
    """

    def __init__(self, floor_tokens: float, features: StepFeatures, limit_ms: float, cost: CostModel) -> None:
        self.floor_tokens = floor_tokens
        self.features = features
        self.limit_ms = limit_ms
        self.cost = cost

    def fits(self, start: int, length: int) -> bool:
        """Whether the piece [start, start + length) of a prompt fits: the step's prompt tokens
        with it stay within `floor_tokens`, or the step with it is predicted within `limit_ms`.
        When it does not, a shorter piece (another prompt's tail) still may."""
        if self.features.prefill_tokens + length <= self.floor_tokens:
            return True
        return self.cost.step_ms(self.features.with_piece(start, length)) <= self.limit_ms

    def spend(self, start: int, length: int) -> None:
        """Add the piece to the step's features."""
        self.features = self.features.with_piece(start, length)


class StepBudget:
    """genserve's step-sizing policy (the module docstring says it whole).

    Args:
        config: the engine's dials (`max_rows`, `prefill_token_budget`,
            `prefill_token_budget_few_rows`, `few_rows`, `tpot_target_ms`, `gap_target_ms`).
        chunked_prefill: prompts are cut into pieces within the budget (False: whole prompts).
    """

    def __init__(self, config: EngineConfig, chunked_prefill: bool) -> None:
        self.config = config
        self.chunked_prefill = chunked_prefill

    def full_rows(self) -> int:
        """Rows of a full step, for the device-time estimate of a request at admission: 32, the
        design's full step, whatever `max_rows` says (as the per-token costs always were)."""
        return 32

    def queue_rows(self) -> int:
        """Rows the queued-work estimate assumes a join may fill (`admission.waiting_work_ms`):
        `max_rows`."""
        return self.config.max_rows

    def rows_fit(self, running: Sequence[Request], req: Request) -> bool:
        """Whether `req`'s rows may join the `running` ones (blocks are checked elsewhere): at
        most `max_rows` rows (running, their pending forks and `req`'s samples)."""
        return rows_with(running, req) <= self.config.max_rows

    def aged_after_s(self) -> float:
        """Seconds a prompt prefills (from its latest admission) before it goes ahead of the
        prompts that joined after it: `AGED_AFTER_BUDGETS` × `queue_budget_s`."""
        return AGED_AFTER_BUDGETS * self.config.queue_budget_s

    def is_aged(self, req: Request, now: float) -> bool:
        """Whether `req` has been in the running batch `aged_after_s` or longer at `now` (s, the
        scheduler's clock, as `req.joined_s`), so its prefill goes ahead of later prompts; False
        for a request that never joined."""
        return req.joined_s is not None and now - req.joined_s >= self.aged_after_s()

    def prefill_tiebreak(self, req: Request, now: float) -> tuple[int, float]:
        """Among prompts of equally served keys, the smaller value fills the step first (`now`:
        seconds, the scheduler's clock, as `req.joined_s`).

        (1, prompt tokens still to prefill) for most prompts, so the nearest-done prompt goes
        first (shortest remaining prefill first, the order that minimizes mean completion time
        on one server; Schrage 1968). A short prompt is not stuck behind a long one, and a
        started prompt finishes before a newer one of its length starts, where least-done-first
        shared every step among all waiting prompts and moved every first token late.
        (0, joined_s) once a prompt has been in the running batch `aged_after_s` or longer
        (`is_aged`): it goes ahead of the others, earliest joined first, which bounds how long
        shorter prompts that join later can pass it over. The time a request waited in the queue for a row
        does not count (the queue is first-come-first-served within a key already)."""
        if self.is_aged(req, now):
            return (0, req.joined_s)
        return (1, req.num_prompt - req.num_computed)

    def request_step_tokens(self) -> int:
        """The most prompt tokens of one request a step computes when its pool has sliding-window
        KV groups (`engine.core.kv_groups`): `EngineConfig.prefill_step_tokens` with chunked
        prefill (the scheduler stops a request's pieces there, however much more the cost model
        would allow), `max_context` (its whole prompt) without. A sliding group holds its window
        plus this many tokens (`BlockPool.blocks_to_compute`), so admission counts that many."""
        return self.config.prefill_step_tokens if self.chunked_prefill else self.config.max_context

    def floor_tokens(self, plan: StepPlan) -> int:
        """Prompt tokens `plan` may carry whatever the cost model predicts:
        `prefill_token_budget_few_rows` with at most `few_rows` decode rows, else
        `prefill_token_budget` (the design's caps)."""
        cfg = self.config
        return cfg.prefill_token_budget_few_rows if plan.num_decode_rows <= cfg.few_rows else cfg.prefill_token_budget

    def for_step(self, plan: StepPlan, now: float, cost: CostModel) -> PaceBudget:
        """The prefill budget of `plan` once its decode rows are in it (`now`: seconds, the
        scheduler's clock): `floor_tokens` and `step_limit_ms`; whole prompts when prefill is
        not chunked."""
        if not self.chunked_prefill:
            return PaceBudget(math.inf, plan.features(), math.inf, cost)
        return PaceBudget(self.floor_tokens(plan), plan.features(), self.step_limit_ms(plan, now), cost)

    def step_limit_ms(self, plan: StepPlan, now: float) -> float:
        """The longest step (ms) the targets allow, given the rows that sample in `plan`.

        A row with n tokens since its first, the first at f and the last at l, keeps its time per
        output token within the target T while the step ends by f + n·T, and its gap within the
        target G while it ends by l + G. The step may take the least of these over its rows, but
        never less than T (a row already behind is served at the target pace) nor more than G;
        G when no row decodes.
        """
        tpot, gap = self.config.tpot_target_ms, self.config.gap_target_ms
        limit = gap
        for seg in plan.segments:
            req = seg.request
            if not (seg.decode and seg.samples) or req.stats.first_token_s is None or req.stats.last_token_s is None:
                continue
            n = len(req.generated)
            own = min(gap - (now - req.stats.last_token_s) * 1000.0, n * tpot - (now - req.stats.first_token_s) * 1000.0)
            limit = min(limit, max(tpot, own))
        return limit
