"""The per-request record and its sampling settings.

`Request` is the one mutable record a request has inside the engine. Its writers, each of its own
fields: the scheduler (`engine.core.sched`) changes `state`, `num_computed`, `generated`, the
timestamps and counters; `Engine.submit` stamps `arrival_s` and `deadline_s`; the model runner
keeps the request's `generator`; any thread may set `cancel_requested` or `stop_requested`. Its
blocks are in the block pool, by request id. The service reads `state` to trace a request's
admissions and preemptions (`service.tracing`) and otherwise sees only the `TokenEvent`s pushed
through the request's `on_event` callback.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from engine.core.outputs import FinishReason, TokenEvent

if TYPE_CHECKING:
    import torch


class RequestState(enum.Enum):
    """Life cycle: QUEUED → RUNNING → DONE, with RUNNING → PREEMPTED → RUNNING and CANCELLED.

    There is no separate prefill state: a running request computes its prompt's pieces and then
    decodes, and which it does next follows from how much is computed (`Request.is_prefilling`).
    """

    QUEUED = "queued"
    RUNNING = "running"
    PREEMPTED = "preempted"
    DONE = "done"
    CANCELLED = "cancelled"


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request sampling settings.

    Attributes:
        temperature: softmax temperature; 0 means greedy (argmax). Must be >= 0.
        top_k: keep the k most likely tokens; 0 or negative means off.
        top_p: nucleus mass in (0, 1]; 1 means off.
        seed: seed of the request's own `torch.Generator`; None draws a random seed.
        ignore_eos: keep generating past the end-of-sequence token (benchmarks, as in vLLM).
        top_logprobs: how many most-likely alternatives to report per token (0..5).
        logprobs: report each sampled token's log-probability (and `top_logprobs` alternatives);
            when no row of a step asks, the sampler skips the log-softmax over the vocabulary.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    top_logprobs: int = 0
    logprobs: bool = False

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax (temperature 0)."""
        return self.temperature == 0.0


@dataclass(eq=False, slots=True)
class Request:
    """One generation request as the scheduler sees it.

    Attributes:
        request_id: unique id, chosen by the client or the service.
        api_key: the caller's key (fair-queueing account); "" for anonymous.
        prompt_ids: prompt token ids, length 1..max_context.
        max_tokens: most tokens to generate, 1..max_new_tokens.
        sampling: temperature, top-k, top-p, seed.
        arrival_s: clock time at submit, seconds (the engine's clock).
        deadline_s: clock time after which the request is cancelled, seconds.
        on_event: called from the scheduler thread with every `TokenEvent`; must not block.
        eos_token_id: the model's end-of-sequence id, or None.
        est_device_ms: estimated device time of the whole request, ms (set at submit).
        state: life-cycle state; changed only by the scheduler.
        num_computed: tokens of `prompt_ids + generated` whose K/V are in the cache.
        generated: sampled token ids so far.
        generator: the request's own random generator (its state survives preemption).
        cancel_requested: set by any thread; read by the scheduler at the next step boundary.
        stop_requested: set by the service when a stop string matched; the row leaves at the
            next step boundary with FinishReason.STOP.
        index: sample index within its group (0 for the request the client sent).
        parent: for samples 1..n-1 of an n > 1 request, the sample-0 request that prefills the
            shared prompt; None otherwise.
        children: samples 1..n-1, forked from this request when its prompt is prefilled.
        admitted_s / first_token_s / last_token_s / finished_s: clock times, seconds.
        max_gap_s: longest time between two consecutive tokens, seconds.
        steps_after_cancel: steps the request was part of after its cancel flag was set (the
            design bounds this by 1).
        finish_reason / finish_detail: why it ended ("deadline", an error text...).
        prefix_hashes: chained hashes of the prompt's full blocks (`block_pool.prefix_block_hashes`),
            computed once when prefix caching is on; None before.
        num_cached: prompt tokens its last admission took from the prefix cache (0 with none).
        cache_salt: the client's narrowing of its prefix-cache scope (vLLM's `cache_salt`): only
            requests with the same salt (and, under the default scope, the same key) share
            cached blocks; "" for none.
    """

    request_id: str
    api_key: str
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    arrival_s: float
    deadline_s: float
    on_event: Callable[[TokenEvent], None] | None = None
    eos_token_id: int | None = None
    est_device_ms: float = 0.0
    state: RequestState = RequestState.QUEUED
    num_computed: int = 0
    generated: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    cancel_requested: bool = False
    stop_requested: bool = False
    index: int = 0
    parent: "Request | None" = None
    children: list["Request"] = field(default_factory=list)
    admitted_s: float | None = None
    first_token_s: float | None = None
    last_token_s: float | None = None
    max_gap_s: float = 0.0
    steps_after_cancel: int = 0
    finished_s: float | None = None
    finish_reason: FinishReason | None = None
    finish_detail: str = ""
    prefix_hashes: list[bytes] | None = None
    num_cached: int = 0
    cache_salt: str = ""

    @property
    def num_prompt(self) -> int:
        """Prompt length in tokens."""
        return len(self.prompt_ids)

    @property
    def is_prefilling(self) -> bool:
        """True while the request runs and part of its prompt is not computed yet (its next
        segments are prefill pieces; after that, decode rows)."""
        return self.state is RequestState.RUNNING and self.num_computed < len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.prompt_ids) + len(self.generated)

    def token_at(self, position: int) -> int:
        """Token id at `position` of prompt + generated (0-based)."""
        n = len(self.prompt_ids)
        return self.prompt_ids[position] if position < n else self.generated[position - n]

    @property
    def group_id(self) -> str:
        """The id the client knows: the parent's request_id for forked samples."""
        return self.parent.request_id if self.parent is not None else self.request_id

    @property
    def n(self) -> int:
        """Samples this request stands for: 1 + its forked samples."""
        return 1 + len(self.children)

    @property
    def forks_now(self) -> bool:
        """True when the next sample is this request's first and it has samples to fork."""
        return bool(self.children) and not self.generated

    def fork(self, n: int, seeds: list[int | None]) -> None:
        """Attach samples 1..n-1 (not queued; the scheduler activates them after prefill).

        Args:
            n: samples in all (1..8).
            seeds: the seed of each sample's generator (index 0 is this request's own).
        """
        for i in range(1, n):
            self.children.append(Request(
                request_id=f"{self.request_id}/{i}", api_key=self.api_key,
                prompt_ids=self.prompt_ids, max_tokens=self.max_tokens,
                sampling=replace(self.sampling, seed=seeds[i]), arrival_s=self.arrival_s,
                deadline_s=self.deadline_s, on_event=self.on_event,
                eos_token_id=self.eos_token_id, index=i, parent=self, cache_salt=self.cache_salt))

    @property
    def finished(self) -> bool:
        """True once the request left the engine (DONE or CANCELLED)."""
        return self.state in (RequestState.DONE, RequestState.CANCELLED)
