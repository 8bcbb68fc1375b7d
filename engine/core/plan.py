"""What the schedule stage hands the execute stage: a `StepPlan` of `Segment`s.

A step is a flat batch: decode rows (one token of a request past its prompt) followed by
prefill pieces (a run of prompt tokens of one request, at most `prefill_piece` long and cut on
that grid). Both are `Segment`s. Torch-free, so the scheduler, the loop and the virtual-time
simulator load without the model. The execute stage's answer and the events pushed to clients
are in `engine.core.outputs`; its interface is `engine.core.executor.Executor`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from engine.core.cost_model import StepFeatures, piece_pairs
from engine.core.outputs import TokenEvent
from engine.core.request import Request


class Lifecycle(enum.Enum):
    """What happened to a request while a step was scheduled (its finish is a `TokenEvent`)."""

    ADMITTED = "admitted"          # first admission to the running batch
    PREEMPTED = "preempted"        # blocks freed, queued again first for its key
    READMITTED = "readmitted"      # admitted again after a preemption


@dataclass(frozen=True, slots=True)
class LifecycleEvent:
    """A request's lifecycle change in one step, in the order the scheduler made them.

    Attributes:
        request: the request (a forked sample too; samples start with their parent and have no
            ADMITTED of their own).
        kind: what happened.
        time_s: the scheduler's clock when it happened, seconds.
    """

    request: Request
    kind: Lifecycle
    time_s: float


@dataclass(frozen=True, slots=True)
class Segment:
    """A run of consecutive tokens of one request computed in one step.

    Attributes:
        request: the request the tokens belong to.
        start: position of the first token (== request.num_computed when scheduled).
        length: tokens in the run; 1 for a decode row, at most `prefill_piece` for a prefill
            piece.
        samples: True when the run ends at the request's last token, so its last position's
            logits are sampled (the last prefill piece, or a decode row).
        block_table: the request's block ids covering positions [0, start + length), in KV group
            0 (`engine.core.kv_groups`; the only group of a model without sliding windows).
        decode: True for a decode row (a request past its prompt: one token, costed as a row).
        group_tables: the block tables of KV groups 1 .. G - 1, the same length as
            `block_table` (a sliding group's entries out of its window are the null block 0).
    """

    request: Request
    start: int
    length: int
    samples: bool
    block_table: tuple[int, ...]
    decode: bool = False
    group_tables: tuple[tuple[int, ...], ...] = ()

    @property
    def end(self) -> int:
        """Context length after this run: start + length."""
        return self.start + self.length

    @property
    def sample_requests(self) -> list[Request]:
        """Whose generators draw from this segment's last logits row, in order.

        Empty when it does not sample; the request and its n - 1 forked samples when it is the
        last prefill piece of an n > 1 request (all n first tokens come from the one prompt pass);
        else just the request.
        """
        if not self.samples:
            return []
        return [self.request, *self.request.children] if self.request.forks_now else [self.request]


@dataclass(slots=True)
class StepPlan:
    """What one forward pass computes: decode rows first, then prefill pieces.

    The flat token list the executor builds from `segments` is `token_ids[B + C]`,
    `positions[B + C]` and `request_of_token[B + C]` (B decode rows, C prefill tokens); no padding.

    Attributes:
        segments: decode rows (length 1) followed by prefill pieces, in that order.
        events: finish events produced while scheduling (cancelled, deadline, preempted-away).
        num_preempted: requests preempted while building this step.
        block_copies: (source, destination) block ids to copy before the forward pass
            (copy-on-write of a shared, partially filled prompt block).
        lifecycle: admissions, preemptions and readmissions made while building this step, in
            order (step listeners, the tracer among them, read them instead of polling states).
    """

    segments: list[Segment] = field(default_factory=list)
    events: list[TokenEvent] = field(default_factory=list)
    num_preempted: int = 0
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    lifecycle: list[LifecycleEvent] = field(default_factory=list)

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
    def wants_prompt_logprobs(self) -> bool:
        """True when a prefill piece's request asks for prompt logprobs
        (`SamplingParams.prompt_logprobs`)."""
        return any(not s.decode and s.request.sampling.prompt_logprobs is not None
                   for s in self.segments)

    @property
    def empty(self) -> bool:
        """True when there is nothing to run."""
        return not self.segments

    def features(self) -> StepFeatures:
        """What the step-time model reads from this step (`engine.core.cost_model`): its decode
        segments are rows, the others prefill pieces."""
        rows = prefill = context = pairs = 0
        for seg in self.segments:
            if seg.decode:
                rows += 1
                context += seg.end
            else:
                prefill += seg.length
                pairs += piece_pairs(seg.start, seg.length)
        return StepFeatures(rows, prefill, context, pairs)
