"""The bridge's request and response schemas: the bodies of /v1/completions,
/v1/chat/completions, /tokenize and /detokenize and their translation to gRPC requests, and the
response fields both completion endpoints answer alike (`finish_reason` names, the `timing`
object).

The bridge checks the JSON *shape*: field names, types, and that values fit the
proto's integer types. Numeric *ranges* (max_tokens <= 1000, 0 <= top_p <= 1,
logprobs <= 5, prompt + max_tokens <= context ...) are the service's to check;
it answers INVALID_ARGUMENT, which the bridge maps to 400. Which fields exist and what each does
is bridge/fields.py's policy table (`COMPLETIONS`, `CHAT`); `policy_refusal` applies it to a
parsed body.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from typing import Annotated, Any, ClassVar

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, StrictBool, StrictFloat, StrictInt,
                      StrictStr)
from pydantic import field_validator, model_validator

from bridge.constraints import BodyConstraint, ConstraintFieldError, body_constraint
from bridge.tools import GENERIC, ToolFormat, ToolSetup, render_messages, tool_setup
from bridge.fields import CHAT, COMPLETIONS, FieldRefused, Rule, enforce, recorded
from genserve.common.chat_messages import parse_messages
from genserve.v1 import generate_pb2 as pb

UINT32_MAX = 2**32 - 1
UINT64_MAX = 2**64 - 1
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1

# Integer types as the proto carries them.
Uint32 = Annotated[StrictInt, Field(ge=0, le=UINT32_MAX)]
Uint64 = Annotated[StrictInt, Field(ge=0, le=UINT64_MAX)]
Int32 = Annotated[StrictInt, Field(ge=INT32_MIN, le=INT32_MAX)]
# A finite JSON number (an int is accepted where a float is expected).
Float = Annotated[StrictFloat, Field(allow_inf_nan=False)]


def _token_key(value: Any) -> int:
    """A `logit_bias` key: a token id written as a JSON object key ("123")."""
    if isinstance(value, str) and value.isascii() and value.isdigit():
        return int(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise ValueError(f"keys must be token ids written as strings (\"123\"), got {value!r}")


TokenKey = Annotated[int, BeforeValidator(_token_key), Field(ge=0, le=UINT32_MAX)]

# OpenAI's defaults for an absent (or null) field.
DEFAULT_MAX_TOKENS = 16
DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_K = 0  # off; -1 also means off
DEFAULT_TOP_P = 1.0
DEFAULT_N = 1

# A Finished message's reason -> the responses' `finish_reason`.
FINISH_REASON_NAME: dict[int, str] = {
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_CANCELLED: "cancelled",
}

MIN_PROMPT_LOGPROB = -9999.0     # vLLM's floor for a prompt logprob (-inf is not JSON)
TIMING_DECIMALS = 3     # final events' timing values, ms to the microsecond (finer digits are clock noise)


def timing_json(timing: pb.Timing) -> dict:
    """A sample's {"queue_ms", "ttft_ms", "e2e_ms"} (see `timing_ms`); "ttft_ms" is null when the
    sample ended before its first token (the engine then leaves `Timing.ttft_ms` unset)."""
    return timing_ms(timing.queue_ms, timing.ttft_ms if timing.HasField("ttft_ms") else None, timing.e2e_ms)


def timing_ms(queue_ms: float, ttft_ms: float | None, e2e_ms: float) -> dict:
    """The `timing` object of a final event (or of a whole completion), in ms rounded to
    TIMING_DECIMALS; `ttft_ms` None stays null (no first token)."""
    return {"queue_ms": round(queue_ms, TIMING_DECIMALS),
            "ttft_ms": None if ttft_ms is None else round(ttft_ms, TIMING_DECIMALS),
            "e2e_ms": round(e2e_ms, TIMING_DECIMALS)}


def completion_timing(timings: Iterable[pb.Timing]) -> dict | None:
    """The `timing` object of a whole non-streamed completion from its samples' final timings:
    the longest queue wait, the earliest first token among the samples that had one (null when
    none had one) and the latest end (ms, `timing_ms`); None when no sample reported a timing."""
    timings = list(timings)
    if not timings:
        return None
    first = [t.ttft_ms for t in timings if t.HasField("ttft_ms")]
    return timing_ms(max(t.queue_ms for t in timings), min(first, default=None),
                     max(t.e2e_ms for t in timings))


def token_label(token_id: int, text: str, as_id: bool) -> str:
    """A token as a `logprobs` entry names it: its text, or with vLLM's
    `return_tokens_as_token_ids` ``"token_id:<id>"`` (a token holding part of a character, or
    text that is not valid JSON on its own, stays identifiable)."""
    return f"token_id:{token_id}" if as_id else text


def prompt_logprobs_json(msg: pb.PromptLogprobs, k: int) -> list[dict | None]:
    """vLLM's `prompt_logprobs` of a prompt: one entry per prompt token, null for the first
    (nothing comes before it), then ``{"<token id>": {"logprob", "rank", "decoded_token"}}`` with
    the prompt token itself first and the `k` most likely alternatives (rank 1 the most likely).
    The prompt token's `rank` is its place among the alternatives when it is one of them, else
    null (the engine reports the top `k` only). A logprob below `MIN_PROMPT_LOGPROB` (-inf) is
    that value, as vLLM clamps it, and one that is not a number is null, so the answer stays JSON."""
    out: list[dict | None] = []
    for tok in msg.tokens:
        if not tok.HasField("logprob"):
            out.append(None)
            continue
        top = list(tok.top_logprobs)[:k]
        rank = next((r for r, t in enumerate(top, 1) if t.token_id == tok.token_id), None)
        entry = {str(tok.token_id): {"logprob": _json_logprob(tok.logprob), "rank": rank,
                                     "decoded_token": tok.text}}
        for r, t in enumerate(top, 1):
            entry.setdefault(str(t.token_id), {"logprob": _json_logprob(t.logprob), "rank": r,
                                               "decoded_token": t.text})
        out.append(entry)
    return out


def _json_logprob(value: float) -> float | None:
    return None if math.isnan(value) else max(value, MIN_PROMPT_LOGPROB)


def stop_list(value: Any) -> list[str] | None:
    """`stop` as OpenAI accepts it (null, a string, or a list of strings) as a list.

    Raises:
        ValueError: any other shape (pydantic reports it as a 400 naming `stop`).
    """
    if value is None:
        return None
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return value
    raise ValueError("must be a string or a list of strings")


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= UINT32_MAX


def _token_ids(value: list) -> list[int]:
    if not all(_is_token_id(v) for v in value):
        raise ValueError("token ids must be integers from 0 to 2**32-1")
    return value


AnyObject = dict[str, Any]


class StreamOptions(BaseModel):
    """OpenAI's ``stream_options``: ``include_usage`` adds a last chunk with the usage;
    vLLM's ``continuous_usage_stats`` puts each choice's usage so far on every chunk;
    ``include_obfuscation`` is accepted and does nothing (nothing is padded)."""

    model_config = ConfigDict(extra="forbid")

    include_usage: StrictBool | None = False
    continuous_usage_stats: StrictBool | None = False
    include_obfuscation: StrictBool | None = None


class SamplingBody(BaseModel):
    """The fields /v1/completions and /v1/chat/completions share: OpenAI's `model`, the sampling
    settings, `n`, `stream`, `stream_options`, `user`, vLLM's sampling extensions and genserve's
    `deadline_s` (bridge/fields.py says what each does)."""

    model_config = ConfigDict(extra="forbid")

    model: StrictStr | None = None     # the served model or a LoRA adapter (gRPC `lora`); responses name it
    temperature: Float | None = DEFAULT_TEMPERATURE
    top_k: Int32 | None = DEFAULT_TOP_K
    top_p: Float | None = DEFAULT_TOP_P
    stop: list[str] | None = None
    seed: Uint64 | None = None
    n: Uint32 | None = DEFAULT_N
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool | None = False
    deadline_s: Float | None = None  # seconds from arrival; the service caps it at its default
    cache_salt: StrictStr | None = None  # vLLM's: narrows the prefix-cache scope (engine checks length)
    user: StrictStr | None = None
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
    logit_bias: dict[TokenKey, Float] | None = None
    repetition_penalty: Float | None = None
    min_p: Float | None = None
    min_tokens: Uint32 | None = None
    stop_token_ids: list[Uint32] | None = None
    include_stop_str_in_output: StrictBool | None = None
    skip_special_tokens: StrictBool | None = None
    # Output constraints, vLLM's names (bridge/constraints.py).
    structured_outputs: AnyObject | None = None
    guided_json: AnyObject | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None

    # The endpoint's policy table (bridge/fields.py).
    policy: ClassVar[dict[str, Rule]] = {}

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_shape(cls, value: Any) -> list[str] | None:
        return stop_list(value)

    @property
    def num_samples(self) -> int:
        """n, with null meaning the default."""
        return DEFAULT_N if self.n is None else self.n

    @property
    def include_usage(self) -> bool:
        """Whether a streamed answer ends with a usage chunk (``stream_options.include_usage``)."""
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Whether every streamed chunk carries its choice's usage so far
        (``stream_options.continuous_usage_stats``, vLLM's)."""
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def set_fields(self) -> dict[str, Any]:
        """The fields the body sent, with their values (null ones included)."""
        return {name: getattr(self, name) for name in self.model_fields_set}

    def policy_refusal(self) -> FieldRefused | None:
        """The first refusal of the field policy (bridge/fields.py), or None."""
        try:
            enforce(self.set_fields(), self.policy)
            self.constraint()
        except FieldRefused as refused:
            return refused
        except ConstraintFieldError as e:           # a malformed value, not an unsupported one
            return FieldRefused(e.field, e.message, code="invalid_argument")
        return None

    def constraint(self) -> BodyConstraint | None:
        """The output constraint the body asks for (bridge/constraints.py), or None.

        Raises:
            ConstraintFieldError: a malformed one, or several.
        """
        return body_constraint({name: getattr(self, name, None) for name in
                                ("response_format", "structured_outputs", "guided_json", "guided_regex",
                                 "guided_choice", "guided_grammar")})

    def recorded_fields(self) -> dict[str, Any]:
        """The fields the policy records (`user`, `metadata`, ...) that the body set."""
        return recorded(self.set_fields(), self.policy)

    def engine_fields(self) -> dict[str, str]:
        """gRPC request field -> the REST field this body sent for it, where the names differ:
        an engine error names the gRPC field, the client's 400 names its own
        (`bridge.errors.rename_param`). Here: the output constraint's (``choice`` ->
        ``guided_choice``); the endpoints add their own. Call after `policy_refusal` found
        nothing (a malformed constraint raises ConstraintFieldError)."""
        constraint = self.constraint()
        return constraint.rest_fields() if constraint is not None else {}

    def sampling_proto(self) -> pb.SamplingParams:
        """The gRPC SamplingParams of these fields: null or absent fields take OpenAI's (or
        vLLM's) defaults, and those the proto marks optional stay absent.

        Raises:
            ValueError: a `logit_bias` key that is not a token id (the caller answers 400).
        """
        sampling = pb.SamplingParams(
            temperature=DEFAULT_TEMPERATURE if self.temperature is None else self.temperature,
            top_k=DEFAULT_TOP_K if self.top_k is None else self.top_k,
            top_p=DEFAULT_TOP_P if self.top_p is None else self.top_p,
            ignore_eos=bool(self.ignore_eos),
            stop=self.stop or [],
            stop_token_ids=self.stop_token_ids or [],
            include_stop_str_in_output=bool(self.include_stop_str_in_output),
        )
        for name in ("seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p",
                     "min_tokens", "skip_special_tokens"):
            value = getattr(self, name)
            if value is not None:
                setattr(sampling, name, value)
        for token, bias in (self.logit_bias or {}).items():
            sampling.logit_bias[token] = bias
        return sampling


PromptInput = str | list[int]


def prompt_logprobs_refusal(prompt_logprobs: int | None, stream: bool | None) -> FieldRefused | None:
    """`prompt_logprobs` with `stream` is refused, as vLLM refuses it (they are reported with the
    whole answer only); else None."""
    if prompt_logprobs is not None and stream:
        return FieldRefused("prompt_logprobs", "'prompt_logprobs' is not supported with 'stream' (as in "
                                               "vLLM): they come with the whole answer; send stream: false")
    return None


class CompletionRequest(SamplingBody):
    """Body of POST /v1/completions."""

    policy: ClassVar[dict[str, Rule]] = COMPLETIONS

    # A string, a list of strings, token ids, or a list of token-id lists: normalized to a list
    # of prompts, each text or token ids.
    prompt: list[PromptInput] | None = None
    prompt_token_ids: list[Uint32] | None = None
    max_tokens: Uint32 | None = DEFAULT_MAX_TOKENS
    logprobs: Uint32 | None = None
    echo: StrictBool | None = False
    best_of: Uint32 | None = None
    suffix: StrictStr | None = None
    # vLLM's extensions: an output format as chat's (`json_object`, `json_schema`), token ids in
    # place of token texts in `logprobs`, and the prompt tokens' logprobs.
    response_format: AnyObject | None = None
    return_tokens_as_token_ids: StrictBool | None = None
    prompt_logprobs: Uint32 | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value: Any) -> Any:
        if value is None:
            return None
        if isinstance(value, str):
            return [value]
        if isinstance(value, list):
            if not value:
                raise ValueError("must not be an empty list")
            if all(isinstance(v, str) for v in value):
                return value
            if all(isinstance(v, list) for v in value):
                return [_token_ids(v) for v in value]
            if not any(isinstance(v, str | list) for v in value):
                return [_token_ids(value)]
            raise ValueError("must be a string, a list of strings, a list of token ids, "
                             "or a list of token-id lists")
        raise ValueError("must be a string, a list of strings or token ids")

    @model_validator(mode="after")
    def _one_prompt(self) -> CompletionRequest:
        if (self.prompt is None) == (self.prompt_token_ids is None):
            raise ValueError("exactly one of 'prompt' or 'prompt_token_ids' is required")
        return self

    @property
    def prompts(self) -> list[PromptInput]:
        """The prompts, in order (one for `prompt_token_ids`)."""
        return self.prompt if self.prompt is not None else [self.prompt_token_ids]

    @property
    def engine_samples(self) -> int:
        """Samples the engine draws per prompt: `best_of` (null: `n`)."""
        return self.num_samples if self.best_of is None else self.best_of

    def policy_refusal(self) -> FieldRefused | None:
        """The policy's refusal (bridge/fields.py), or one of the combinations OpenAI refuses too:
        `best_of` below `n` or with `stream`."""
        refused = super().policy_refusal()
        if refused is not None:
            return refused
        if self.best_of is not None:
            if self.best_of < self.num_samples:
                return FieldRefused("best_of", f"'best_of' ({self.best_of}) must be at least 'n' "
                                               f"({self.num_samples})")
            if self.stream and self.best_of > 1:
                return FieldRefused("best_of", "'best_of' cannot be used with 'stream' (the best "
                                               "samples are known only once all have finished)")
        return prompt_logprobs_refusal(self.prompt_logprobs, self.stream)

    def engine_fields(self) -> dict[str, str]:
        """As `SamplingBody.engine_fields`, and: `n` is `best_of` when that is set (the engine
        draws best_of samples); token ids sent as `prompt` are `prompt_token_ids` to the engine;
        the engine's `prompt_logprobs` is the body's, or `logprobs` when only echo asked for it."""
        names = super().engine_fields()
        if self.best_of is not None:
            names["n"] = "best_of"
        if self.prompt is not None:
            names["prompt_token_ids"] = "prompt"
        if self.prompt_logprobs is None:
            names["prompt_logprobs"] = "logprobs"
        return names

    def to_proto(self, prompt: PromptInput, request_id: str = "") -> pb.GenerateRequest:
        """The gRPC request for one of the prompts; null fields take OpenAI's defaults,
        seed/logprobs stay absent. With `best_of` the engine draws `best_of` samples, with
        logprobs (the choice is made on them); `echo` with `logprobs` asks for the prompt's
        logprobs too (`prompt_logprobs`, the same number of alternatives)."""
        sampling = self.sampling_proto()
        request = pb.GenerateRequest(
            max_tokens=DEFAULT_MAX_TOKENS if self.max_tokens is None else self.max_tokens,
            sampling=sampling,
            n=self.engine_samples,
            request_id=request_id,
        )
        if self.logprobs is not None:
            request.logprobs = self.logprobs
            if self.echo:
                request.prompt_logprobs = self.logprobs
        elif self.engine_samples > self.num_samples:
            request.logprobs = 0           # best_of ranks samples by their tokens' logprobs
        if self.prompt_logprobs is not None:     # one engine count serves both asks
            request.prompt_logprobs = max(self.prompt_logprobs, request.prompt_logprobs
                                          if request.HasField("prompt_logprobs") else 0)
        if self.deadline_s is not None:
            request.deadline_s = self.deadline_s
        constraint = self.constraint()
        if constraint is not None:
            constraint.set_on(request)
        if self.cache_salt is not None:
            request.cache_salt = self.cache_salt
        if self.model:
            request.lora = self.model        # the engine: its own name or "" is the base model
        if isinstance(prompt, str):
            request.prompt = prompt
        else:
            request.prompt_token_ids.SetInParent()  # set the oneof even for an empty list
            request.prompt_token_ids.ids.extend(prompt)
        return request


class ChatCompletionRequest(SamplingBody):
    """Body of POST /v1/chat/completions.

    ``messages`` is checked by `to_proto` (genserve/common/chat_messages.py: roles, content types), which
    raises ChatError naming the field (``messages[1].role``), a 400; the template is the engine's
    (an INVALID_ARGUMENT naming ``messages`` when it refuses them). Absent (or null) `max_tokens`
    and `max_completion_tokens` leave the gRPC request's max_tokens absent: for chat the engine
    then allows as many tokens as its limit and the context leave.
    """

    policy: ClassVar[dict[str, Rule]] = CHAT

    messages: list[Any]
    max_tokens: Uint32 | None = None
    max_completion_tokens: Uint32 | None = None
    logprobs: StrictBool | None = False
    top_logprobs: Uint32 | None = None
    # Accepted with no effect, or recorded (bridge/fields.py).
    metadata: dict[str, StrictStr] | None = None
    store: StrictBool | None = None
    service_tier: StrictStr | None = None
    safety_identifier: StrictStr | None = None
    prompt_cache_key: StrictStr | None = None
    prompt_cache_retention: StrictStr | None = None
    prompt_cache_options: AnyObject | None = None
    prediction: AnyObject | None = None
    reasoning_effort: StrictStr | None = None
    verbosity: StrictStr | None = None
    parallel_tool_calls: StrictBool | None = None
    # vLLM's: token ids in place of token texts in `logprobs`, and the prompt tokens' logprobs.
    return_tokens_as_token_ids: StrictBool | None = None
    prompt_logprobs: Uint32 | None = None
    response_format: AnyObject | None = None
    tools: list[Any] | None = None
    tool_choice: StrictStr | AnyObject | None = None
    functions: list[Any] | None = None
    function_call: StrictStr | AnyObject | None = None
    modalities: list[StrictStr] | None = None
    audio: AnyObject | None = None
    web_search_options: AnyObject | None = None
    moderation: AnyObject | None = None
    # The served model's tool-call format (`use_tool_format`; the engine's Info says which).
    _tool_format: ToolFormat = PrivateAttr(default=GENERIC)

    @model_validator(mode="after")
    def _consistent(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs: true")
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise ValueError("max_tokens and max_completion_tokens differ; send one")
        return self

    def uses_tools(self) -> bool:
        """Whether the request has tools, earlier tool calls or tool results: its prompt and
        answer then depend on the served model's tool-call format (`use_tool_format`)."""
        return bool(self.tools) or any(isinstance(m, dict) and (m.get("role") == "tool" or m.get("tool_calls"))
                                       for m in self.messages)

    @property
    def tool_format(self) -> ToolFormat:
        """The tool-call format calls are written and read in (`use_tool_format`)."""
        return self._tool_format

    def use_tool_format(self, fmt: ToolFormat) -> None:
        """Write and read tool calls in `fmt` (the engine's ``InfoResponse.tool_call_parser``;
        default: the generic prompt)."""
        self._tool_format = fmt

    def tool_setup(self) -> ToolSetup | None:
        """The request's tools when a call may be made (bridge/tools.py), in the served model's
        format, or None (no tools, or `tool_choice` "none"). Raises ConstraintFieldError."""
        return tool_setup(self.tools, self.tool_choice, self.parallel_tool_calls, self._tool_format)

    def policy_refusal(self) -> FieldRefused | None:
        """The policy's refusal (bridge/fields.py), or `prompt_logprobs` with `stream` (as vLLM)."""
        return super().policy_refusal() or prompt_logprobs_refusal(self.prompt_logprobs, self.stream)

    def engine_fields(self) -> dict[str, str]:
        """As `SamplingBody.engine_fields` (with the tool-call grammar's: ``grammar`` ->
        ``tools``), and: the engine's `max_tokens` is `max_completion_tokens` when the body
        sent that; its `logprobs` (a count of alternatives) is `top_logprobs`."""
        names = super().engine_fields()
        if self.max_completion_tokens is not None and self.max_tokens is None:
            names["max_tokens"] = "max_completion_tokens"
        if self.top_logprobs is not None:
            names["logprobs"] = "top_logprobs"
        return names

    def constraint(self) -> BodyConstraint | None:
        """The output constraint: the body's (`SamplingBody.constraint`) or the tool-call grammar.

        Raises:
            ConstraintFieldError: a malformed one, or tools that may be called with another.
        """
        asked = super().constraint()
        setup = self.tool_setup()
        if setup is None:
            return asked
        if asked is not None:
            raise ConstraintFieldError(asked.rest_field, "cannot be combined with tools that may be called")
        return BodyConstraint("grammar", setup.grammar(), "tools")

    def to_proto(self, request_id: str = "") -> pb.GenerateRequest:
        """The gRPC request: the messages as `ChatMessages`, null fields at OpenAI's defaults.

        Raises:
            ChatError: a message is malformed (its field named).
        """
        sampling = self.sampling_proto()
        max_tokens = next((v for v in (self.max_completion_tokens, self.max_tokens) if v is not None),
                          None)
        request = pb.GenerateRequest(sampling=sampling, n=self.num_samples, request_id=request_id)
        if max_tokens is not None:
            request.max_tokens = max_tokens
        if self.logprobs:
            request.logprobs = self.top_logprobs or 0
        if self.prompt_logprobs is not None:
            request.prompt_logprobs = self.prompt_logprobs
        if self.deadline_s is not None:
            request.deadline_s = self.deadline_s
        constraint = self.constraint()
        if constraint is not None:
            constraint.set_on(request)
        if self.cache_salt is not None:
            request.cache_salt = self.cache_salt
        if self.model:
            request.lora = self.model        # the engine: its own name or "" is the base model
        request.chat.CopyFrom(chat_messages_proto(self.messages, self.tool_setup(), self._tool_format))
        return request


def chat_messages_proto(messages: Any, setup: ToolSetup | None = None,
                        fmt: ToolFormat = GENERIC) -> pb.ChatMessages:
    """OpenAI-style messages as the gRPC ChatMessages the engine renders, every message checked
    (`parse_messages`). The one path from a REST conversation to the prompt, for chat (and so
    Responses) and /tokenize alike, so that /tokenize counts exactly what chat does.

    With a model whose template defines tool calls (`fmt` native: hermes, llama3_json, mistral),
    assistant ``tool_calls`` and ``role: "tool"`` messages go as they are and the callable tools
    (`setup`) as ``tools_json``: the template writes them. Otherwise (the generic format) tool
    calls and tool results are written as text (`bridge.tools.render_messages`) and with callable
    tools the generic tool prompt comes first.

    Raises:
        ChatError: naming the client's field at fault (``messages[2].tool_calls[0].function.name``).
    """
    if not fmt.native:
        out = [pb.ChatMessage(role=m.role, content=m.content) for m in parse_messages(render_messages(messages))]
        if setup is not None:
            out.insert(0, pb.ChatMessage(role="system", content=setup.system_text()))
        return pb.ChatMessages(messages=out)
    if isinstance(messages, list):
        # null means absent (the openai SDK's `message.model_dump()` sends refusal, audio, ... as
        # null; an empty tool_calls is no call), as for the generic format
        messages = [{k: v for k, v in m.items()
                     if (v is not None or k == "content") and not (k == "tool_calls" and v == [])}
                    if isinstance(m, dict) else m for m in messages]
    chat = pb.ChatMessages(messages=[
        pb.ChatMessage(role=m.role, content=m.content or "", tool_call_id=m.tool_call_id or "",
                       tool_calls=[pb.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in m.tool_calls])
        for m in parse_messages(messages, tools=True)])
    if setup is not None:
        chat.tools_json = json.dumps(list(setup.tools), ensure_ascii=False)
    return chat


class TokenizeRequest(BaseModel):
    """Body of POST /tokenize (vLLM's): a `prompt`, or chat `messages` (with the `tools` the chat
    request offers, as vLLM's tokenize takes them) rendered with the model's template, tokenized
    exactly as a completion's or chat's prompt is counted."""

    model_config = ConfigDict(extra="forbid")

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[Any] | None = None
    tools: list[Any] | None = None
    # Tokens are counted as generation counts them: the model's tokenizer adds what its file says.
    add_special_tokens: StrictBool | None = None
    add_generation_prompt: StrictBool | None = None   # true only: generation opens the assistant turn
    return_token_strs: StrictBool | None = None      # false only

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("exactly one of 'prompt' or 'messages' is required")
        return self

    def policy_refusal(self) -> FieldRefused | None:
        """The values /tokenize does not support, or None."""
        if self.add_generation_prompt is False:
            return FieldRefused("add_generation_prompt", "'add_generation_prompt' false is not supported: "
                                "genserve renders conversations with the assistant's turn opened")
        if self.return_token_strs:
            return FieldRefused("return_token_strs", "'return_token_strs' is not supported yet")
        if self.tools and self.prompt is not None:
            return FieldRefused("tools", "'tools' go with 'messages' (the tool prompt is part of a conversation)")
        return None

    def to_proto(self, fmt: ToolFormat = GENERIC) -> pb.TokenizeRequest:
        """The gRPC request: the prompt, or the conversation as chat sends it in the served
        model's tool-call format `fmt` (`chat_messages_proto`: the tools as a chat request with
        them and `tool_choice` auto, required or named gives them).

        Raises:
            ChatError: naming a bad message's field.
            ConstraintFieldError: naming a malformed tool (``tools[0]``).
        """
        if self.prompt is not None:
            return pb.TokenizeRequest(prompt=self.prompt)
        setup = tool_setup(self.tools, None, None, fmt)
        return pb.TokenizeRequest(chat=chat_messages_proto(self.messages, setup, fmt))

    def uses_tools(self) -> bool:
        """Whether the conversation has tools, tool calls or tool results (see
        `ChatCompletionRequest.uses_tools`)."""
        return bool(self.tools) or any(isinstance(m, dict) and (m.get("role") == "tool" or m.get("tool_calls"))
                                       for m in self.messages or ())


class DetokenizeRequest(BaseModel):
    """Body of POST /detokenize (vLLM's): token ids to turn into text."""

    model_config = ConfigDict(extra="forbid")

    model: StrictStr | None = None
    tokens: list[Uint32]


class LoadLoraAdapterRequest(BaseModel):
    """Body of POST /v1/load_lora_adapter (vLLM's): a PEFT adapter directory on the engine's host
    and the name requests will give as `model`."""

    model_config = ConfigDict(extra="forbid")

    lora_name: StrictStr
    lora_path: StrictStr

    def to_proto(self) -> pb.LoadLoraAdapterRequest:
        """The LoadLoraAdapter call's request."""
        return pb.LoadLoraAdapterRequest(lora_name=self.lora_name, lora_path=self.lora_path)


class UnloadLoraAdapterRequest(BaseModel):
    """Body of POST /v1/unload_lora_adapter (vLLM's): the adapter to stop serving (vLLM also
    accepts `lora_int_id`; genserve names adapters only)."""

    model_config = ConfigDict(extra="forbid")

    lora_name: StrictStr

    def to_proto(self) -> pb.UnloadLoraAdapterRequest:
        """The UnloadLoraAdapter call's request."""
        return pb.UnloadLoraAdapterRequest(lora_name=self.lora_name)
