"""How big a step may be (`EngineConfig.policy`): the rows that fit, and its prefill budget.

Two strategies, chosen once (`step_budget_for`):

* `FixedBudget` ("fixed", the design's caps; and every policy when prompts are not chunked):
  at most `max_rows` rows; `prefill_token_budget` prompt tokens a step
  (`prefill_token_budget_few_rows` with at most `few_rows` decode rows), or whole prompts when
  prefill is not chunked.
* `SloBudget` ("slo" with continuous chunked batching): rows while the cost model predicts that
  they and the prefill they bring meet the TPOT and gap targets (at most `slo_row_limit`), and
  prefill pieces while the step's predicted time stays within what its rows' targets allow.

Either way the budget decides how many pieces run, never where a prompt is cut: the scheduler cuts
every prompt on the `prefill_piece` grid and asks, piece by piece, whether the next one still fits
(`PrefillBudget`). Pure arithmetic over the cost model: no clock (time is an argument), no tensors.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from engine.config import EngineConfig
from engine.core.cost_model import CostModel, StepFeatures, piece_pairs
from engine.core.plan import StepPlan
from engine.core.request import Request

__all__ = ["FixedBudget", "PieceFit", "PrefillBudget", "RequestAverages", "SloBudget", "StepBudget",
           "step_budget_for"]


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


class PieceFit(enum.Enum):
    """Whether the next prefill piece fits the step (`PrefillBudget.check`)."""

    FITS = "fits"
    """Reserve its blocks and add it."""
    NEXT_REQUEST = "next request"
    """Not this request's piece; another request's may still fit."""
    STEP_FULL = "step full"
    """No further piece of any request joins this step."""


class PrefillBudget(Protocol):
    """One step's prefill budget, consumed piece by piece while the step is built."""

    def check(self, start: int, length: int) -> PieceFit:
        """Whether the piece [start, start + length) of a prompt fits what is left."""
        ...

    def spend(self, length: int) -> None:
        """Count a piece of `length` tokens that was added to the step."""
        ...


class StepBudget(Protocol):
    """A step-sizing policy: rows that fit, a step's prefill budget, the order prompts fill it."""

    def full_rows(self, cost: CostModel, averages: RequestAverages) -> int:
        """Rows of a full step, for the device-time estimate of a request at admission."""
        ...

    def queue_rows(self, cost: CostModel, averages: RequestAverages) -> int:
        """Rows the queued-work estimate assumes a join may fill (`admission.waiting_work_ms`)."""
        ...

    def rows_fit(self, running: Sequence[Request], req: Request, cost: CostModel,
                 averages: RequestAverages) -> bool:
        """Whether `req`'s rows may join the `running` ones (blocks are checked elsewhere)."""
        ...

    def prefill_tiebreak(self, req: Request) -> float:
        """Among prompts of equally served keys, the smaller value fills the step first."""
        ...

    def for_step(self, plan: StepPlan, now: float, cost: CostModel) -> PrefillBudget:
        """The prefill budget of the step `plan`, once its decode rows are in it."""
        ...


class TokenBudget:
    """A prefill budget in prompt tokens (`math.inf`: whole prompts).

    Args:
        tokens: prompt tokens the step may carry.
    """

    def __init__(self, tokens: float) -> None:
        self.tokens = tokens

    def check(self, start: int, length: int) -> PieceFit:
        """FITS while `length` tokens are left; else NEXT_REQUEST (a shorter piece may fit)."""
        return PieceFit.NEXT_REQUEST if length > self.tokens else PieceFit.FITS

    def spend(self, length: int) -> None:
        """`length` tokens fewer left."""
        self.tokens -= length


class TimeBudget:
    """A prefill budget in predicted step time: pieces join while the cost model predicts the
    step within `limit_ms` (at least one piece when no row decodes).

    The piece's predicted time is counted from `check` on, whether or not its blocks can then be
    reserved, so the step's prediction only errs long.

    Args:
        features: the step so far (its decode rows).
        limit_ms: the longest the step may take, ms.
        cost: the cost model that predicts it.
    """

    def __init__(self, features: StepFeatures, limit_ms: float, cost: CostModel) -> None:
        self.features = features
        self.limit_ms = limit_ms
        self.cost = cost

    def check(self, start: int, length: int) -> PieceFit:
        """STEP_FULL when the step with this piece is predicted over `limit_ms` (and is not
        empty without it), else FITS, counting the piece."""
        grown = self.features.with_piece(start, length)
        if (self.features.rows or self.features.prefill_tokens) and self.cost.step_ms(grown) > self.limit_ms:
            return PieceFit.STEP_FULL
        self.features = grown
        return PieceFit.FITS

    def spend(self, length: int) -> None:
        """Nothing more: `check` counted the piece."""


class FixedBudget:
    """The design's fixed caps: `max_rows` rows; `prefill_token_budget` prompt tokens a step,
    `prefill_token_budget_few_rows` with at most `few_rows` decode rows, or whole prompts when
    prefill is not chunked. Prompts of equally served keys go shortest remaining prefill first.

    Args:
        config: the engine's dials.
        chunked_prefill: prompts are cut into pieces within the token budget (False: no budget).
    """

    def __init__(self, config: EngineConfig, chunked_prefill: bool) -> None:
        self.config = config
        self.chunked_prefill = chunked_prefill

    def full_rows(self, cost: CostModel, averages: RequestAverages) -> int:
        """32: the design's full step, whatever `max_rows` says (as the per-token costs always were)."""
        return 32

    def queue_rows(self, cost: CostModel, averages: RequestAverages) -> int:
        """`max_rows`."""
        return self.config.max_rows

    def rows_fit(self, running: Sequence[Request], req: Request, cost: CostModel,
                 averages: RequestAverages) -> bool:
        """At most `max_rows` rows (running, their pending forks and `req`'s samples)."""
        return rows_with(running, req) <= self.config.max_rows

    def prefill_tiebreak(self, req: Request) -> float:
        """Prompt tokens still to prefill: the nearest-done prompt first (shortest remaining
        prefill first, the order that minimizes mean completion time on one server; Schrage
        1968). A short prompt is not stuck behind a long one, and a started prompt finishes
        before a newer one of its length starts, where least-done-first shared every step among
        all waiting prompts and moved every first token late. Admission's queue budget bounds
        how long a long prompt can be passed over."""
        return req.num_prompt - req.num_computed

    def for_step(self, plan: StepPlan, now: float, cost: CostModel) -> TokenBudget:
        """`prefill_token_budget_few_rows` tokens with at most `few_rows` decode rows in `plan`,
        else `prefill_token_budget`; unlimited when prefill is not chunked."""
        cfg = self.config
        tokens = (cfg.prefill_token_budget_few_rows if plan.num_decode_rows <= cfg.few_rows
                  else cfg.prefill_token_budget) if self.chunked_prefill else math.inf
        return TokenBudget(tokens)


class SloBudget:
    """SLO-driven steps ("slo"): each step sized with the cost model to meet the TPOT and gap
    targets. Prompts of equally served keys go oldest first, and nothing skips past a piece that
    does not fit: pieces of newer prompts would become rows that keep it from ever fitting.

    Args:
        config: the engine's dials (`tpot_target_ms`, `gap_target_ms`, `slo_prefill_share`,
            `slo_row_limit`, `prefill_piece`).
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._full_rows_key: tuple[int, int, int, int] | None = None
        self._full_rows = config.max_rows

    def full_rows(self, cost: CostModel, averages: RequestAverages) -> int:
        """The most rows (1..`slo_row_limit`, at least 1) that `decode_rows_fit` allows at the
        average context (prompt + half an answer).

        Found by bisection and kept until the cost model (its identity or version) or the
        averages (context in 64-token steps, answer in 8-token steps) move; the kept value is
        the one found with the averages of that moment.
        """
        cfg = self.config
        context = int(averages.prompt_tokens + averages.output_tokens / 2)
        key = (id(cost), cost.version, context // 64, int(averages.output_tokens) // 8)
        if key != self._full_rows_key:           # the model may be replaced, the averages move
            self._full_rows_key = key
            lo, hi = 1, cfg.slo_row_limit
            while lo < hi:                       # the step time grows with the rows
                mid = (lo + hi + 1) // 2
                if self.decode_rows_fit(StepFeatures(rows=mid, context=mid * context), cost, averages):
                    lo = mid
                else:
                    hi = mid - 1
            self._full_rows = lo
        return self._full_rows

    def queue_rows(self, cost: CostModel, averages: RequestAverages) -> int:
        """`full_rows`."""
        return self.full_rows(cost, averages)

    def rows_fit(self, running: Sequence[Request], req: Request, cost: CostModel,
                 averages: RequestAverages) -> bool:
        """At most `slo_row_limit` rows, and (unless nothing runs) every running row plus `req`'s,
        at their current contexts, within what `decode_rows_fit` allows."""
        rows = rows_with(running, req)
        if rows > self.config.slo_row_limit:
            return False
        if running:
            context = (sum(r.num_tokens + len(r.children) * r.num_prompt * r.forks_now for r in running)
                       + req.n * req.num_prompt)
            if not self.decode_rows_fit(StepFeatures(rows=rows, context=context), cost, averages):
                return False
        return True

    def decode_rows_fit(self, decode: StepFeatures, cost: CostModel, averages: RequestAverages) -> bool:
        """Whether the decode rows `decode` (rows and their summed context, no prefill) may all
        run: their step plus the prefill they bring in steady state fits the TPOT target, and
        their step plus one prefill piece fits the gap target.

        Steady state: every row that leaves is replaced by a new one whose prompt must be
        prefilled while the others decode, so each row brings an average prompt's prefill spread
        over an average answer's steps (`row_prefill_ms`), and never less than
        `slo_prefill_share` of the target in all. A step may stretch to the gap target when its
        rows are ahead of their TPOT pace (`step_limit_ms`), so a piece that does not fit beside
        the rows within the TPOT target still runs there; the rows never grow so many that it
        cannot.
        """
        cfg = self.config
        decode_ms = cost.step_ms(decode)
        prefill_ms = max(cfg.slo_prefill_share * cfg.tpot_target_ms,
                         decode.rows * self.row_prefill_ms(cost, averages))
        return (decode_ms + prefill_ms <= cfg.tpot_target_ms
                and decode_ms + self.piece_ms(cost, averages) <= cfg.gap_target_ms)

    def row_prefill_ms(self, cost: CostModel, averages: RequestAverages) -> float:
        """The prefill time one decoding row brings to every step in steady state, ms: an average
        prompt's prefill (`CostModel.prefill_ms`) over an average answer's tokens."""
        return cost.prefill_ms(int(averages.prompt_tokens)) / max(1.0, averages.output_tokens)

    def piece_ms(self, cost: CostModel, averages: RequestAverages) -> float:
        """Step time one `prefill_piece` halfway into an average prompt adds, ms (the smallest
        prefill a step can carry)."""
        cfg = self.config
        start = int(averages.prompt_tokens / 2) // cfg.prefill_piece * cfg.prefill_piece
        piece = StepFeatures(prefill_tokens=cfg.prefill_piece, pairs=piece_pairs(start, cfg.prefill_piece))
        return cost.step_ms(piece) - cost.step_base_ms

    def prefill_tiebreak(self, req: Request) -> float:
        """Admission time: the oldest prompt first."""
        return req.admitted_s

    def for_step(self, plan: StepPlan, now: float, cost: CostModel) -> TimeBudget:
        """Pieces while the step is predicted within `step_limit_ms`."""
        return TimeBudget(plan.features(), self.step_limit_ms(plan, now), cost)

    def step_limit_ms(self, plan: StepPlan, now: float) -> float:
        """The longest step (ms) the SLO targets allow, given the rows that sample in `plan`.

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
            if not (seg.decode and seg.samples) or req.first_token_s is None or req.last_token_s is None:
                continue
            n = len(req.generated)
            own = min(gap - (now - req.last_token_s) * 1000.0, n * tpot - (now - req.first_token_s) * 1000.0)
            limit = min(limit, max(tpot, own))
        return limit


def step_budget_for(config: EngineConfig, chunked_prefill: bool) -> StepBudget:
    """`SloBudget` under `config.policy` "slo" with chunked prefill (the SLO policy sizes pieces,
    so it needs them), else `FixedBudget`."""
    if config.policy == "slo" and chunked_prefill:
        return SloBudget(config)
    return FixedBudget(config, chunked_prefill)
