"""The per-request record and its sampling settings.

A `Request` is three parts, each with its owners (the split of vLLM v1's `EngineCoreRequest`,
`Request` and `RequestStats`):
* `input` (`RequestInput`, frozen): what the client asked for; nothing changes it.
* the scheduler's state, the record's own attributes: `state`, `num_computed`, `generated`,
  forks, finish reason, prefix hashes. The scheduler (`engine.core.sched`) writes them;
  `Engine.submit` sets `deadline_s`; any thread may set `cancel_requested`, and the service
  `stop_requested`.
* `stats` (`RequestStats`): arrival, admission, token and finish times, gaps, cached tokens,
  stamped by `Engine.submit` and the scheduler, read for latencies and metrics.

Its blocks are in the block pool, by request id. The service learns of admissions and
preemptions from each step's plan (`StepPlan.lifecycle`, which `service.tracing` reads) and
otherwise sees only the `TokenEvent`s pushed through the request's `on_event` callback. The model
runner writes nothing here: what it keeps per request (generator, logits processors' state,
grammar matcher) is its own (`engine.runner.request_state`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from engine.core.outputs import FinishReason, TokenEvent



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

    The logits of a row go through, in this order (vLLM's; `engine.runner.logits_processors`):
    the repetition penalty, the frequency and presence penalties, `logit_bias`, the `min_tokens`
    ban; then temperature, top-k, top-p and min-p shape the distribution the token is drawn from
    (`engine.runner.sampler`). Reported logprobs are of the raw logits, before all of it.

    Attributes:
        temperature: softmax temperature; 0 means greedy (argmax). Must be >= 0.
        top_k: keep the k most likely tokens; 0 or negative means off.
        top_p: nucleus mass in (0, 1]; 1 means off.
        seed: seed of the request's own `torch.Generator`; None draws a random seed.
        ignore_eos: keep generating past the end-of-sequence token (benchmarks, as in vLLM).
        top_logprobs: how many most-likely alternatives to report per token (0..5).
        logprobs: report each sampled token's log-probability (and `top_logprobs` alternatives);
            when no row of a step asks, the sampler skips the log-softmax over the vocabulary.
        presence_penalty: subtracted once from the logit of every token already generated
            (OpenAI's definition, over the generated tokens only); 0 is off. -2..2.
        frequency_penalty: subtracted from a token's logit once per time it was generated
            (OpenAI's definition); 0 is off. -2..2.
        repetition_penalty: a token in the prompt or generated so far has its logit divided by
            it when positive, multiplied when negative (Keskar et al. 2019, CTRL, as in Hugging
            Face transformers and vLLM); 1 is off. > 0.
        min_p: after temperature, drop tokens whose probability is below min_p times the most
            likely token's (vLLM's, from Nguyen et al. 2024); 0 is off. 0..1.
        logit_bias: (token id, bias) pairs added to those logits (OpenAI's `logit_bias`; -100
            in effect bans a token, 100 forces it). Sorted by id, ids distinct.
        min_tokens: the end-of-sequence token and `stop_token_ids` cannot be sampled (their logits
            are -inf) until this many tokens were generated; stop strings do not match before
            then either (the service's part). 0 is off.
        stop_token_ids: token ids that end the sample (FinishReason.STOP) like EOS does, also
            with `ignore_eos`.
        prompt_logprobs: report each prompt token's logprob given the tokens before it, with
            this many top alternatives (0..5), computed in the prefill the request runs anyway
            (vLLM's `prompt_logprobs`); None is off. Such a request takes nothing from the prefix
            cache (a cached block's positions would have no logits).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    top_logprobs: int = 0
    logprobs: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    prompt_logprobs: int | None = None

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax (temperature 0)."""
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """True when a repetition, frequency or presence penalty is set (the row's logits depend
        on the tokens before it)."""
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)

    @property
    def processes_logits(self) -> bool:
        """True when anything changes the row's logits before sampling (penalties, a bias,
        `min_tokens` with tokens to ban)."""
        return self.penalized or bool(self.logit_bias) or self.min_tokens > 0


@dataclass(frozen=True, slots=True)
class LoraRequest:
    """The LoRA adapter a request runs on (vLLM's `LoRARequest`), resolved by name when the request
    is made (`engine.model.lora.LoraRegistry.request`).

    Attributes:
        name: the adapter's served name (what the client sent as `model`).
        lora_id: the load's id, unique per load of any adapter in the process (> 0): an adapter
            unloaded and loaded again under the same name gets a new id, so the prefix cache (whose
            scope includes both) never serves blocks computed under the old weights.
        adapter: the loaded adapter itself (`engine.model.lora.LoraAdapter`, host copies of its
            matrices), held here so a request keeps running on it after an unload; opaque to the
            scheduling core, read only by the model runner.
    """

    name: str
    lora_id: int
    adapter: Any = field(default=None, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class RequestInput:
    """What the client asked for, fixed from submission on (vLLM's `EngineCoreRequest`).

    Attributes:
        request_id: unique id, chosen by the client or the service (a forked sample's is
            "<id>/<index>").
        api_key: the caller's key (fair-queueing account); "" for anonymous.
        prompt_ids: prompt token ids, length 1..max_context.
        max_tokens: most tokens to generate, 1..max_new_tokens.
        sampling: temperature, top-k, top-p, seed...
        eos_token_id: the model's end-of-sequence id, or None.
        on_event: called from the scheduler thread with every `TokenEvent`; must not block.
        constraint: the compiled grammar its output must follow
            (`engine.structured.compiler.CompiledGrammar`), or None; forked samples share it.
        cache_salt: the client's narrowing of its prefix-cache scope (vLLM's `cache_salt`): only
            requests with the same salt (and, under the default scope, the same key) share
            cached blocks; "" for none.
        lora: the LoRA adapter its rows run on (`LoraRequest`), or None for the base model; part
            of its prefix-cache scope.
    """

    request_id: str
    api_key: str
    prompt_ids: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams
    eos_token_id: int | None = None
    on_event: Callable[[TokenEvent], None] | None = None
    constraint: Any = None
    cache_salt: str = ""
    lora: LoraRequest | None = None


@dataclass(slots=True)
class RequestStats:
    """When things happened to a request and what it cost: clock times in seconds (the engine's
    clock), written by `Engine.submit` (arrival) and the scheduler, read for latencies
    (`final_event`), metrics and traces.

    Attributes:
        arrival_s: clock time at submit.
        admitted_s: its first admission to the running batch (None while it never ran).
        first_token_s / last_token_s / finished_s: clock times, or None.
        max_gap_s: longest time between two consecutive tokens.
        steps_after_cancel: steps the request was part of after its cancel flag was set (the
            design bounds this by 1).
        num_cached: prompt tokens its last admission took from the prefix cache (0 with none).
    """

    arrival_s: float = 0.0
    admitted_s: float | None = None
    first_token_s: float | None = None
    last_token_s: float | None = None
    finished_s: float | None = None
    max_gap_s: float = 0.0
    steps_after_cancel: int = 0
    num_cached: int = 0


class Request:
    """One generation request as the scheduler sees it: the client's immutable `input`, the
    scheduler's state (the attributes below), and its `stats`.

    The input's fields read through properties of the same names (`request_id`, `prompt_ids`,
    `sampling` ...); nothing assigns them.

    Args:
        request_id, api_key, prompt_ids, max_tokens, sampling, eos_token_id, on_event,
            constraint, cache_salt, lora: the `RequestInput`.
        arrival_s: clock time at submit, seconds (`Engine.submit` stamps it again).
        deadline_s: clock time after which the request is cancelled, seconds.
        index: sample index within its group (0 for the request the client sent).
        parent: for samples 1..n-1 of an n > 1 request, the sample-0 request that prefills the
            shared prompt; None otherwise.

    Attributes (the scheduler's state):
        input: the `RequestInput`.
        stats: the `RequestStats`.
        deadline_s: as above; `Engine.submit` sets it from the request's timeout.
        est_device_ms: estimated device time of the whole request, ms (set at submit).
        state: life-cycle state; changed only by the scheduler.
        num_computed: tokens of `prompt_ids + generated` whose K/V are in the cache.
        generated: sampled token ids so far.
        cancel_requested: set by any thread; read by the scheduler at the next step boundary.
        stop_requested: set by the service when a stop string matched; the row leaves at the
            next step boundary with FinishReason.STOP.
        index, parent: as above.
        children: samples 1..n-1, forked from this request when its prompt is prefilled.
        joined_s: clock time of its latest admission to the running batch, seconds (set again
            when it is admitted after a preemption; None while it never ran): the prefill order's
            age bound counts from it (`StepBudget.prefill_tiebreak`).
        finish_reason / finish_detail: why it ended ("deadline", an error text...).
        prefix_hashes: chained hashes of the prompt's full blocks (`block_pool.prefix_block_hashes`),
            computed once when prefix caching is on; None before.
        prompt_logprob_entries: with `sampling.prompt_logprobs`, the scheduler's list of
            (logprob, top alternatives) per prompt position 1..num_prompt-1 (None until
            computed), filled piece by piece and pushed before the first token.
    """

    __slots__ = ("input", "stats", "deadline_s", "est_device_ms", "state", "num_computed",
                 "generated", "cancel_requested", "stop_requested", "index", "parent", "children",
                 "joined_s", "finish_reason", "finish_detail", "prefix_hashes",
                 "prompt_logprob_entries")

    def __init__(self, request_id: str, api_key: str, prompt_ids: Sequence[int], max_tokens: int,
                 sampling: SamplingParams, arrival_s: float, deadline_s: float,
                 on_event: Callable[[TokenEvent], None] | None = None,
                 eos_token_id: int | None = None, *, index: int = 0, parent: "Request | None" = None,
                 constraint: Any = None, cache_salt: str = "", lora: LoraRequest | None = None) -> None:
        self.input = RequestInput(request_id, api_key, tuple(prompt_ids), max_tokens, sampling,
                                  eos_token_id, on_event, constraint, cache_salt, lora)
        self.stats = RequestStats(arrival_s=arrival_s)
        self.deadline_s = deadline_s
        self.est_device_ms = 0.0
        self.state = RequestState.QUEUED
        self.num_computed = 0
        self.generated: list[int] = []
        self.cancel_requested = False
        self.stop_requested = False
        self.index = index
        self.parent = parent
        self.children: list[Request] = []
        self.joined_s: float | None = None
        self.finish_reason: FinishReason | None = None
        self.finish_detail = ""
        self.prefix_hashes: list[bytes] | None = None
        self.prompt_logprob_entries: list | None = None

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, state={self.state.value}, prompt={self.num_prompt}, "
                f"computed={self.num_computed}, generated={len(self.generated)})")

    # -- the client's input, read-only ----------------------------------------------------------
    @property
    def request_id(self) -> str:
        """`RequestInput.request_id`."""
        return self.input.request_id

    @property
    def api_key(self) -> str:
        """`RequestInput.api_key`."""
        return self.input.api_key

    @property
    def prompt_ids(self) -> tuple[int, ...]:
        """`RequestInput.prompt_ids`."""
        return self.input.prompt_ids

    @property
    def max_tokens(self) -> int:
        """`RequestInput.max_tokens`."""
        return self.input.max_tokens

    @property
    def sampling(self) -> SamplingParams:
        """`RequestInput.sampling`."""
        return self.input.sampling

    @property
    def eos_token_id(self) -> int | None:
        """`RequestInput.eos_token_id`."""
        return self.input.eos_token_id

    @property
    def on_event(self) -> Callable[[TokenEvent], None] | None:
        """`RequestInput.on_event`."""
        return self.input.on_event

    @property
    def constraint(self) -> Any:
        """`RequestInput.constraint`."""
        return self.input.constraint

    @property
    def cache_salt(self) -> str:
        """`RequestInput.cache_salt`."""
        return self.input.cache_salt

    @property
    def lora(self) -> LoraRequest | None:
        """`RequestInput.lora`."""
        return self.input.lora

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
        base = self.input
        for i in range(1, n):
            self.children.append(Request(
                f"{base.request_id}/{i}", base.api_key, base.prompt_ids, base.max_tokens,
                replace(base.sampling, seed=seeds[i]), self.stats.arrival_s, self.deadline_s,
                base.on_event, base.eos_token_id, index=i, parent=self,
                constraint=base.constraint, cache_salt=base.cache_salt, lora=base.lora))

    @property
    def finished(self) -> bool:
        """True once the request left the engine (DONE or CANCELLED)."""
        return self.state in (RequestState.DONE, RequestState.CANCELLED)


def final_event(req: Request, now: float, token: int | None = None, logprob: float | None = None,
                top: tuple[tuple[int, float], ...] = ()) -> TokenEvent:
    """The last event of a finished request (`finish_reason` and `finish_detail` already set on
    it), with its token if it ended on one, its token counts and its latencies in ms measured from
    arrival: queue wait (to admission, or to `now` if never admitted), TTFT, end to end (to `now`,
    seconds on the engine's clock) and TPOT, the mean gap between its tokens after the first
    ((last − first) / (n − 1); None below two tokens)."""
    st = req.stats
    ms = lambda t: None if t is None else (t - st.arrival_s) * 1000.0  # noqa: E731
    n = len(req.generated)
    tpot_ms = None
    if n > 1 and st.first_token_s is not None and st.last_token_s is not None:
        tpot_ms = (st.last_token_s - st.first_token_s) * 1000.0 / (n - 1)
    return TokenEvent(
        req.group_id, index=req.index, token_id=token, logprob=logprob, top_logprobs=top,
        position=max(0, n - 1), finish_reason=req.finish_reason, finish_detail=req.finish_detail,
        num_prompt_tokens=req.num_prompt, num_completion_tokens=n,
        num_cached_tokens=(req.parent or req).stats.num_cached,
        queue_ms=ms(st.admitted_s) if st.admitted_s is not None else ms(now),
        ttft_ms=ms(st.first_token_s), e2e_ms=ms(now), tpot_ms=tpot_ms,
        max_gap_ms=st.max_gap_s * 1000.0, steps_after_cancel=st.steps_after_cancel)
