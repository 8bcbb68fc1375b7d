"""What crosses the engine's stage boundaries: schedule → execute → update → push.

The dataclasses each stage hands the next, and the `Executor` interface of the execute stage.
Torch-free, so the scheduler, the loop and the virtual-time simulator load without the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from engine.request import FinishReason, Request

if TYPE_CHECKING:
    from engine.scheduler import CostModel


@dataclass(frozen=True, slots=True)
class Segment:
    """A run of consecutive tokens of one request computed in one step.

    Attributes:
        request: the request the tokens belong to.
        start: position of the first token (== request.num_computed when scheduled).
        length: tokens in the run; 1 for a decode row, up to the prefill chunk for prefill.
        samples: True when the run ends at the request's last token, so its last position's
            logits are sampled (the last prefill chunk, or a decode row).
        block_table: the request's block ids covering positions [0, start + length).
        decode: True for a decode row (a request past its prompt: one token, costed as a row).
    """

    request: Request
    start: int
    length: int
    samples: bool
    block_table: tuple[int, ...]
    decode: bool = False

    @property
    def end(self) -> int:
        """Context length after this run: start + length."""
        return self.start + self.length

    @property
    def sample_requests(self) -> list[Request]:
        """Whose generators draw from this segment's last logits row, in order.

        Empty when it does not sample; the request and its n - 1 forked samples when it is the
        last prefill chunk of an n > 1 request (all n first tokens come from the one prompt pass);
        else just the request.
        """
        if not self.samples:
            return []
        return [self.request, *self.request.children] if self.request.forks_now else [self.request]


@dataclass(slots=True)
class StepPlan:
    """What one forward pass computes: decode rows first, then prefill chunks.

    The flat token list the executor builds from `segments` is `token_ids[B + C]`,
    `positions[B + C]` and `request_of_token[B + C]` (B decode rows, C prefill tokens); no padding.

    Attributes:
        segments: decode rows (length 1) followed by prefill chunks, in that order.
        events: finish events produced while scheduling (cancelled, deadline, preempted-away).
        num_preempted: requests preempted while building this step.
        block_copies: (source, destination) block ids to copy before the forward pass
            (copy-on-write of a shared, partially filled prompt block).
    """

    segments: list[Segment] = field(default_factory=list)
    events: list["TokenEvent"] = field(default_factory=list)
    num_preempted: int = 0
    block_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """Tokens in the flat batch (B + C)."""
        return sum(s.length for s in self.segments)

    @property
    def num_decode_rows(self) -> int:
        """Decode rows (B)."""
        return sum(1 for s in self.segments if s.decode)

    @property
    def num_prefill_tokens(self) -> int:
        """Prompt tokens carried by this step (C)."""
        return sum(s.length for s in self.segments if not s.decode)

    @property
    def sampling_segments(self) -> list[Segment]:
        """Segments whose last position is sampled, in order (one logits row each)."""
        return [s for s in self.segments if s.samples]

    @property
    def draws(self) -> list[tuple[int, Request]]:
        """(logits row, request) of every token to sample, in order: `next_token[len(draws)]`."""
        return [(row, req) for row, seg in enumerate(self.sampling_segments)
                for req in seg.sample_requests]

    @property
    def empty(self) -> bool:
        """True when there is nothing to run."""
        return not self.segments


@dataclass(frozen=True, slots=True)
class SampledTokens:
    """Executor output: one token per draw, in `plan.draws` order.

    Attributes:
        token_ids: next_token[len(plan.draws)], int.
        logprobs: log-probability of each sampled token under the model's distribution, or
            None when the executor does not compute them.
        top_logprobs: per draw, the (token id, logprob) of the most likely tokens, as many as
            that request's `top_logprobs` asks (empty lists when none).
        forward_s: seconds spent in the forward pass and sampling (for calibration).
    """

    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    forward_s: float = 0.0


class Executor(Protocol):
    """Runs the forward and sample stages of one step: `ModelExecutor` (engine/executor.py) runs the
    network, `SimExecutor` (engine/sim_executor.py) a cost model in virtual time.

    Attributes:
        cost_model: per-token costs that feed the scheduler's admission control.
    """

    cost_model: CostModel

    def execute(self, plan: StepPlan) -> SampledTokens:
        """Compute `plan`'s tokens and sample one token per draw (`plan.draws`, in order)."""
        ...


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """What the scheduler pushes to a request's output: one sampled token, or its end.

    Attributes:
        request_id: the request.
        index: sample index (0 unless n > 1).
        token_id: the sampled token, or None on an event that only ends the stream.
        logprob: its log-probability, or None.
        top_logprobs: the most likely alternatives (token id, logprob), when asked.
        position: 0-based index of the token in the completion.
        finish_reason: set on the request's last event.
        finish_detail: why, in words, when not obvious ("deadline", an error message).
        num_prompt_tokens / num_completion_tokens: usage, on the last event.
        queue_ms: arrival → admission, on the last event.
        ttft_ms: arrival → first token sampled, on the last event (None if none was).
        e2e_ms: arrival → finish, on the last event.
        tpot_ms: mean time per output token after the first, on the last event (None if < 2).
        max_gap_ms: longest gap between two consecutive tokens, on the last event.
        steps_after_cancel: steps the request ran after its cancel flag was set (0 or 1).
    """

    request_id: str
    index: int = 0
    token_id: int | None = None
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    position: int = 0
    finish_reason: FinishReason | None = None
    finish_detail: str = ""
    num_prompt_tokens: int = 0
    num_completion_tokens: int = 0
    queue_ms: float | None = None
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    tpot_ms: float | None = None
    max_gap_ms: float = 0.0
    steps_after_cancel: int = 0
