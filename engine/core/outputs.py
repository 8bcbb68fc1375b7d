"""What the engine hands back: the execute stage's sampled tokens, and the events pushed to clients.

`SampledTokens` crosses from execute to update; `TokenEvent` from update to the request's
`on_event` callback (the service's stream); `FinishReason` says why a stream ended. Torch-free.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class FinishReason(str, enum.Enum):
    """Why a stream ended: the model's end-of-sequence token, max_tokens, a cancel, or an error."""

    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"
    ERROR = "error"


@dataclass(frozen=True, slots=True)
class PromptLogprobs:
    """Log-probabilities of a run of prompt tokens, computed in the prefill piece that held them.

    Attributes:
        request_id: the request whose prompt it is.
        first_position: prompt position of the first entry (>= 1: position 0 has no context).
        logprobs: logprob of the prompt token at each position, given the tokens before it.
        top_logprobs: per position, the (token id, logprob) of the most likely tokens there, as
            many as the request's `prompt_logprobs` asks.
    """

    request_id: str
    first_position: int
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]


@dataclass(frozen=True, slots=True)
class SampledTokens:
    """The execute stage's output: one token per draw, in `plan.draws` order.

    Attributes:
        token_ids: next_token[len(plan.draws)], int.
        logprobs: log-probability of each sampled token under the model's distribution, or
            None when the executor does not compute them.
        top_logprobs: per draw, the (token id, logprob) of the most likely tokens, as many as
            that request's `top_logprobs` asks (empty lists when none).
        forward_s: seconds spent in the forward pass and sampling (for calibration).
        prompt_logprobs: the prompt logprobs of the step's prefill pieces whose request asks
            (`SamplingParams.prompt_logprobs`).
    """

    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    forward_s: float = 0.0
    prompt_logprobs: tuple[PromptLogprobs, ...] = ()


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
        num_cached_tokens: prompt tokens taken from the prefix cache (in the request's own cache
            scope), on the last event.
        queue_ms: arrival → admission, on the last event.
        ttft_ms: arrival → first token sampled, on the last event (None if none was).
        e2e_ms: arrival → finish, on the last event.
        tpot_ms: mean time per output token after the first, on the last event (None if < 2).
        max_gap_ms: longest gap between two consecutive tokens, on the last event.
        steps_after_cancel: steps the request ran after its cancel flag was set (0 or 1).
        prompt_logprobs: on an event of its own (no token), just before the first token's, for
            a request that asked: per prompt position from 1, (logprob of that prompt token,
            its top alternatives).
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
    num_cached_tokens: int = 0
    queue_ms: float | None = None
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    tpot_ms: float | None = None
    max_gap_ms: float = 0.0
    steps_after_cancel: int = 0
    prompt_logprobs: tuple[tuple[float, tuple[tuple[int, float], ...]], ...] | None = None
