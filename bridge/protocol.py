"""The bridge's request and response schemas: the bodies of /v1/completions and
/v1/chat/completions and their translation to a gRPC GenerateRequest, and the response fields
both endpoints answer alike (`finish_reason` names, the `timing` object).

The bridge checks the JSON *shape*: field names, types, and that values fit the
proto's integer types. Numeric *ranges* (max_tokens <= 1000, 0 <= top_p <= 1,
logprobs <= 5, prompt + max_tokens <= context ...) are the service's to check;
it answers INVALID_ARGUMENT, which the bridge maps to 400.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr
from pydantic import field_validator, model_validator

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

TIMING_DECIMALS = 3     # final events' timing values, ms to the microsecond (finer digits are clock noise)


def timing_json(timing: pb.Timing) -> dict:
    """A sample's {"queue_ms", "ttft_ms", "e2e_ms"} (see `timing_ms`)."""
    return timing_ms(timing.queue_ms, timing.ttft_ms, timing.e2e_ms)


def timing_ms(queue_ms: float, ttft_ms: float, e2e_ms: float) -> dict:
    """The `timing` object of a final event (or of a whole completion), in ms rounded to
    TIMING_DECIMALS."""
    return {"queue_ms": round(queue_ms, TIMING_DECIMALS), "ttft_ms": round(ttft_ms, TIMING_DECIMALS),
            "e2e_ms": round(e2e_ms, TIMING_DECIMALS)}


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


def sampling_proto(temperature: float | None, top_k: int | None, top_p: float | None,
                   ignore_eos: bool | None, stop: list[str] | None, seed: int | None) -> pb.SamplingParams:
    """The gRPC SamplingParams of a REST body's fields; null fields take OpenAI's defaults and
    an absent seed stays absent."""
    sampling = pb.SamplingParams(
        temperature=DEFAULT_TEMPERATURE if temperature is None else temperature,
        top_k=DEFAULT_TOP_K if top_k is None else top_k,
        top_p=DEFAULT_TOP_P if top_p is None else top_p,
        ignore_eos=bool(ignore_eos),
        stop=stop or [],
    )
    if seed is not None:
        sampling.seed = seed
    return sampling


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= UINT32_MAX


class SamplingBody(BaseModel):
    """The fields /v1/completions and /v1/chat/completions share: OpenAI's `model`, the sampling
    settings, `n`, `stream`, and genserve's `ignore_eos` and `deadline_s`."""

    model_config = ConfigDict(extra="forbid")

    model: StrictStr | None = None     # accepted (OpenAI clients send it); responses name the served model
    temperature: Float | None = DEFAULT_TEMPERATURE
    top_k: Int32 | None = DEFAULT_TOP_K
    top_p: Float | None = DEFAULT_TOP_P
    stop: list[str] | None = None
    seed: Uint64 | None = None
    n: Uint32 | None = DEFAULT_N
    stream: StrictBool | None = False
    ignore_eos: StrictBool | None = False
    deadline_s: Float | None = None  # seconds from arrival; the service caps it at its default

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_shape(cls, value: Any) -> list[str] | None:
        return stop_list(value)

    @property
    def num_samples(self) -> int:
        """n, with null meaning the default."""
        return DEFAULT_N if self.n is None else self.n

    def sampling_proto(self) -> pb.SamplingParams:
        """The gRPC SamplingParams of these fields (`sampling_proto`)."""
        return sampling_proto(self.temperature, self.top_k, self.top_p, self.ignore_eos, self.stop,
                              self.seed)


class CompletionRequest(SamplingBody):
    """Body of POST /v1/completions (the design's fields plus OpenAI's `model`)."""

    # Text, or token ids (OpenAI also allows a one-element list of either).
    prompt: str | list[int] | None = None
    prompt_token_ids: list[Uint32] | None = None
    max_tokens: Uint32 | None = DEFAULT_MAX_TOKENS
    logprobs: Uint32 | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value: Any) -> Any:
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, list):
            if len(value) == 1 and isinstance(value[0], str | list):
                value = value[0]  # OpenAI's one-prompt batch
                if isinstance(value, str):
                    return value
            if all(_is_token_id(v) for v in value):
                return value
            if all(isinstance(v, str | list) for v in value):
                raise ValueError("several prompts in one request are not supported; send one per request")
            raise ValueError("token ids must be integers from 0 to 2**32-1")
        raise ValueError("must be a string or a list of token ids")

    @model_validator(mode="after")
    def _one_prompt(self) -> CompletionRequest:
        if (self.prompt is None) == (self.prompt_token_ids is None):
            raise ValueError("exactly one of 'prompt' or 'prompt_token_ids' is required")
        return self

    def to_proto(self, request_id: str = "") -> pb.GenerateRequest:
        """The gRPC request; null fields take OpenAI's defaults, seed/logprobs stay absent."""
        sampling = self.sampling_proto()
        request = pb.GenerateRequest(
            max_tokens=DEFAULT_MAX_TOKENS if self.max_tokens is None else self.max_tokens,
            sampling=sampling,
            n=self.num_samples,
            request_id=request_id,
        )
        if self.logprobs is not None:
            request.logprobs = self.logprobs
        if self.deadline_s is not None:
            request.deadline_s = self.deadline_s
        if isinstance(self.prompt, str):
            request.prompt = self.prompt
        else:
            ids = self.prompt if self.prompt_token_ids is None else self.prompt_token_ids
            request.prompt_token_ids.SetInParent()  # set the oneof even for an empty list
            request.prompt_token_ids.ids.extend(ids)
        return request


class StreamOptions(BaseModel):
    """OpenAI's ``stream_options``: ``include_usage`` adds a last chunk with the usage."""

    model_config = ConfigDict(extra="forbid")

    include_usage: StrictBool | None = False


class ChatCompletionRequest(SamplingBody):
    """Body of POST /v1/chat/completions.

    ``messages`` is checked by `to_proto` (genserve/common/chat_messages.py: roles, content types), which
    raises ChatError naming the field (``messages[1].role``), a 400; the template is the engine's
    (an INVALID_ARGUMENT naming ``messages`` when it refuses them).
    """

    messages: list[Any]
    max_tokens: Uint32 | None = None
    max_completion_tokens: Uint32 | None = None
    logprobs: StrictBool | None = False
    top_logprobs: Uint32 | None = None
    stream_options: StreamOptions | None = None

    @model_validator(mode="after")
    def _consistent(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs: true")
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise ValueError("max_tokens and max_completion_tokens differ; send one")
        return self

    @property
    def include_usage(self) -> bool:
        """Whether a streamed answer ends with a usage chunk (``stream_options.include_usage``)."""
        return bool(self.stream_options and self.stream_options.include_usage)

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
        if self.deadline_s is not None:
            request.deadline_s = self.deadline_s
        chat = request.chat
        chat.SetInParent()
        for m in parse_messages(self.messages):
            chat.messages.add(role=m.role, content=m.content)
        return request
