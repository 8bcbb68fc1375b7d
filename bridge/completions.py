"""POST /v1/completions: its handler (`completions`), and GenerateResponse messages -> SSE events
and OpenAI completion JSON (`CompletionBuilder`); the request body is
`bridge.protocol.CompletionRequest`.

One `CompletionBuilder` follows one Generate stream (with several prompts, one per prompt read as
one by `bridge.fanout.CallGroup`, whose choice indices are prompt-major, then by sample). Each
message gives at most one event (Started: none, so the first event leaves with the first token;
with `echo`, a choice's first token or finish is preceded by its echo event; the last
Finished also a usage chunk with `stream_options.include_usage`); the builder also accumulates the
whole completion for stream=false, where `best_of` picks each prompt's `n` best samples.

A token event is at once the design's event `{request_id, index, text, token_id,
logprob?}` and an OpenAI completion chunk (`id`, `object`, `created`, `model`,
`choices`), so the `openai` SDK can stream from the bridge.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Annotated, Any

import grpc

from fastapi import Depends, Request
from fastapi.responses import Response

from bridge.errors import ApiError, from_grpc
from bridge.protocol import (FINISH_REASON_NAME, CompletionRequest, completion_timing, prompt_logprobs_json,
                             timing_json, token_label)
from bridge.serving import generate
from bridge.state import BridgeState, auth_metadata, bridge_state
from genserve.v1 import generate_pb2 as pb


@dataclass(slots=True)
class _Sample:
    """What one sample (one choice) has produced so far."""

    text: list[str] = field(default_factory=list)
    text_offset: int = 0
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    text_offsets: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    detail: str = ""
    completion_tokens: int = 0
    timing: pb.Timing | None = None

    def logprobs_json(self, before: "_Sample | None" = None) -> dict:
        """OpenAI's completion `logprobs` object of its tokens, after those of `before` (the
        prompt's, with echo)."""
        parts = [before, self] if before is not None else [self]
        return {"tokens": [t for p in parts for t in p.tokens],
                "token_logprobs": [v for p in parts for v in p.token_logprobs],
                "top_logprobs": [v for p in parts for v in p.top_logprobs],
                "text_offset": [v for p in parts for v in p.text_offsets]}

    def mean_logprob(self) -> float:
        """The mean of its tokens' logprobs (`best_of`'s ranking); -inf without any."""
        values = [v for v in self.token_logprobs if v is not None]
        return sum(values) / len(values) if values else -math.inf


def _prompt_sample(msg: pb.PromptLogprobs, k: int, token_ids: bool = False) -> _Sample:
    """A prompt's tokens as a _Sample (echo with logprobs): texts (or ``token_id:<id>`` with
    `token_ids`), logprobs (the first null), `k` top alternatives (the first null) and text
    offsets from 0."""
    prompt = _Sample()
    for tok in msg.tokens:
        prompt.tokens.append(token_label(tok.token_id, tok.text, token_ids))
        prompt.token_logprobs.append(tok.logprob if tok.HasField("logprob") else None)
        prompt.top_logprobs.append({token_label(t.token_id, t.text, token_ids): t.logprob
                                    for t in list(tok.top_logprobs)[:k]}
                                   if tok.HasField("logprob") else None)
        prompt.text_offsets.append(prompt.text_offset)
        prompt.text_offset += len(tok.text)
    return prompt


class CompletionBuilder:
    """Turns the messages of one Generate stream into events and a completion.

    Args:
        model: the served model's name.
        created: Unix time (s) of the request.
        num_samples: samples the stream carries, all prompts together.
        logprobs: whether the client asked for logprobs.
        num_prompts: prompts of the request (their samples are consecutive indices).
        echo: each prompt's text, to start its choices' text with (`echo`), or None.
        n: choices per prompt in the answer (fewer than the samples with `best_of`).
        include_usage: stream a last chunk with the usage (`stream_options.include_usage`).
        continuous_usage: every streamed chunk carries its choice's usage so far
            (`stream_options.continuous_usage_stats`).
        echo_logprobs: with `echo` and `logprobs`, the alternatives per prompt token its echo
            reports (`logprobs`); None: the echo has no logprobs.
        prompt_logprobs: vLLM's `prompt_logprobs` (alternatives per prompt token), reported on
            each choice of the whole completion; None: not asked.
        token_ids: vLLM's `return_tokens_as_token_ids`: `logprobs` name tokens ``token_id:<id>``.
    """

    def __init__(self, *, model: str, created: int, num_samples: int, logprobs: bool,
                 num_prompts: int = 1, echo: list[str] | None = None, n: int | None = None,
                 include_usage: bool = False, continuous_usage: bool = False,
                 echo_logprobs: int | None = None, prompt_logprobs: int | None = None,
                 token_ids: bool = False) -> None:
        self.model = model
        self.created = created
        self.num_samples = num_samples
        self.logprobs = logprobs  # whether the client asked for logprobs
        self.echo = echo
        self.num_prompts = num_prompts
        self.samples_per_prompt = num_samples // num_prompts
        self.n = self.samples_per_prompt if n is None else n
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage
        self.request_id = ""
        self.prompt_tokens = 0
        self.prompt_tokens_each: list[int] = []      # per prompt; a CallGroup fills it
        self._samples: dict[int, _Sample] = {}
        self._finished: set[int] = set()
        # With echo and logprobs: each prompt's own tokens as a _Sample (its logprobs from the
        # engine's PromptLogprobs message), by prompt index.
        self._prompts: dict[int, _Sample] = {}
        self.echo_logprobs = echo_logprobs
        self.prompt_logprobs = prompt_logprobs
        self.token_ids = token_ids
        self._prompt_logprobs: dict[int, list[dict | None]] = {}   # prompt index -> vLLM's list
        self._cached: dict[int, int] = {}             # prompt index -> prompt tokens from the cache
        self._echoed: set[int] = set()                # samples whose echo event went out

    @property
    def all_finished(self) -> bool:
        """Whether every one of the n samples has sent its Finished message."""
        return len(self._finished) >= self.num_samples

    def _sample(self, index: int) -> _Sample:
        return self._samples.setdefault(index, _Sample())

    def _prompt_index(self, index: int) -> int:
        return min(index // self.samples_per_prompt, self.num_prompts - 1) if self.samples_per_prompt else 0

    def _choice_usage(self, index: int) -> dict:
        prompt = (self.prompt_tokens_each[self._prompt_index(index)]
                  if self.prompt_tokens_each else self.prompt_tokens)
        completion = self._sample(index).completion_tokens
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _chunk(self, index: int, text: str, logprobs: dict | None, finish_reason: str | None) -> dict:
        chunk = {
            "id": self.request_id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [
                {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
            ],
            "request_id": self.request_id,
            "index": index,
        }
        if self.continuous_usage:
            chunk["usage"] = self._choice_usage(index)
        elif self.include_usage:
            chunk["usage"] = None
        return chunk

    def events_for(self, msg: pb.GenerateResponse) -> list[dict]:
        """Record one message; return the SSE events it makes, in order."""
        kind = msg.WhichOneof("event")
        if kind == "started":
            self.on_message(msg)
            return []
        if kind == "prompt_logprobs":      # kept for the echo event (it leaves with the first token)
            k = self._prompt_index(msg.prompt_logprobs.index)      # and for the whole completion
            if self.echo_logprobs is not None:
                self._prompts[k] = _prompt_sample(msg.prompt_logprobs, self.echo_logprobs, self.token_ids)
            if self.prompt_logprobs is not None:
                self._prompt_logprobs[k] = prompt_logprobs_json(msg.prompt_logprobs, self.prompt_logprobs)
            return []
        index = msg.token.index if kind == "token" else msg.finished.index if kind == "finished" else None
        events = [] if index is None else self._echo_event(index)
        event = self.on_message(msg)
        events += [] if event is None else [event]
        if msg.WhichOneof("event") == "finished" and self.include_usage and self.all_finished:
            events.append({"id": self.request_id, "object": "text_completion", "created": self.created,
                           "model": self.model, "choices": [], "usage": self.usage(),
                           "request_id": self.request_id})
        return events

    def _echo_event(self, index: int) -> list[dict]:
        """With `echo`, sample `index`'s prompt (with logprobs, also its tokens' logprobs) as its
        first event, sent with its first token (or its finish) so that the first event of a
        stream comes with the first token; else []."""
        if not self.echo or index in self._echoed:
            return []
        self._echoed.add(index)
        text = self.echo[self._prompt_index(index)]
        self._sample(index).text_offset = len(text)
        prompt = self._prompts.get(self._prompt_index(index))      # echo with logprobs
        event = self._chunk(index, text, None if prompt is None else prompt.logprobs_json(), None)
        event["text"] = text
        return [event]

    def on_message(self, msg: pb.GenerateResponse) -> dict | None:
        """Record one message; return the SSE event it makes (None for Started)."""
        if msg.request_id:
            self.request_id = msg.request_id
        kind = msg.WhichOneof("event")
        if kind == "started":
            self.request_id = msg.started.request_id or self.request_id
            self.prompt_tokens = msg.started.prompt_tokens
            self.model = msg.started.lora or self.model      # the adapter that answers
            return None
        if kind == "token":
            return self._on_token(msg.token)
        if kind == "finished":
            return self._on_finished(msg.finished)
        return None  # an event kind this bridge does not know: skip it

    def _on_token(self, tok: pb.Token) -> dict:
        sample = self._sample(tok.index)
        sample.text.append(tok.text)
        sample.completion_tokens += 1
        logprobs = None
        if tok.HasField("logprob"):
            top = {token_label(t.token_id, t.text, self.token_ids): t.logprob for t in tok.top_logprobs}
            label = token_label(tok.token_id, tok.text, self.token_ids)
            logprobs = {
                "tokens": [label],
                "token_logprobs": [tok.logprob],
                "top_logprobs": [top],
                "text_offset": [sample.text_offset],
            }
            sample.tokens.append(label)
            sample.token_logprobs.append(tok.logprob)
            sample.top_logprobs.append(top)
            sample.text_offsets.append(sample.text_offset)
        sample.text_offset += len(tok.text)
        event = self._chunk(tok.index, tok.text, logprobs if self.logprobs else None, None)
        event["text"] = tok.text
        event["token_id"] = tok.token_id
        event["position"] = tok.position
        if tok.HasField("logprob") and self.logprobs:
            event["logprob"] = tok.logprob
        return event

    def _on_finished(self, fin: pb.Finished) -> dict:
        sample = self._sample(fin.index)
        self._finished.add(fin.index)
        reason = FINISH_REASON_NAME.get(fin.reason)
        sample.finish_reason = reason
        sample.detail = fin.detail
        sample.completion_tokens = fin.usage.completion_tokens if fin.HasField("usage") else sample.completion_tokens
        sample.timing = fin.timing if fin.HasField("timing") else None
        prompt_tokens = fin.usage.prompt_tokens if fin.HasField("usage") else self.prompt_tokens
        event = self._chunk(fin.index, "", None, reason)
        event["finish_reason"] = reason
        cached = fin.usage.cached_tokens if fin.HasField("usage") else 0
        self._cached[self._prompt_index(fin.index)] = cached
        event["usage"] = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": sample.completion_tokens,
            "total_tokens": prompt_tokens + sample.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        event["timing"] = timing_json(fin.timing)
        if fin.detail:
            event["detail"] = fin.detail
        return event

    def usage(self) -> dict:
        """Token counts of the whole request: every prompt once, every sample drawn; OpenAI's
        `prompt_tokens_details.cached_tokens` counts the prompt tokens the prefix cache held."""
        completion_tokens = sum(s.completion_tokens for s in self._samples.values())
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": self.prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": sum(self._cached.values())}}

    def _chosen(self) -> list[tuple[int, _Sample]]:
        """(choice index, sample) of the answer: every sample, or with `best_of` each prompt's
        `n` samples of highest mean token logprob, best first."""
        if self.n >= self.samples_per_prompt:
            return sorted(self._samples.items())
        chosen = []
        for k in range(self.num_prompts):
            first = k * self.samples_per_prompt
            candidates = [(i, self._sample(i)) for i in range(first, first + self.samples_per_prompt)]
            candidates.sort(key=lambda c: (-c[1].mean_logprob(), c[0]))
            chosen += [(k * self.n + rank, sample) for rank, (_, sample) in enumerate(candidates[:self.n])]
        return chosen

    def completion(self) -> dict:
        """The whole completion, OpenAI-style (for stream=false)."""
        choices = []
        for index, sample in self._chosen():
            echo = self.echo[index // self.n] if self.echo else ""
            choice = {
                "index": index,
                "text": echo + "".join(sample.text),
                "logprobs": None,
                "finish_reason": sample.finish_reason,
            }
            if self.logprobs:
                prompt = self._prompts.get(self._prompt_index(index // self.n * self.samples_per_prompt))
                choice["logprobs"] = sample.logprobs_json(prompt)
            if self.prompt_logprobs is not None:
                choice["prompt_logprobs"] = self._prompt_logprobs.get(index // self.n)
            if sample.detail:
                choice["detail"] = sample.detail
            choices.append(choice)
        timing = completion_timing(s.timing for s in self._samples.values() if s.timing is not None)
        return {
            "id": self.request_id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.usage(),
            "timing": timing,
            "request_id": self.request_id,
        }


async def completions(body: CompletionRequest, request: Request,
                      state: Annotated[BridgeState, Depends(bridge_state)]) -> Response:
    """POST /v1/completions: one Generate call per prompt, answered as JSON or (`stream`) as SSE.

    Raises ApiError: a field the policy refuses (bridge/fields.py; 400 naming it), the Generate
    call failed before it started (its status mapped by `bridge.errors.from_grpc`), or, without
    `stream`, while it ran.
    """
    refused = body.policy_refusal()
    if refused is not None:
        raise ApiError(400, refused.message, code=refused.code, param=refused.field)
    prompts = body.prompts
    echo = [await prompt_text(p, request, state) for p in prompts] if body.echo else None
    builder = CompletionBuilder(
        model=state.model_name,      # the served model, or the adapter Started names
        created=int(time.time()),
        num_samples=len(prompts) * body.engine_samples,
        logprobs=body.logprobs is not None,
        num_prompts=len(prompts),
        echo=echo,
        n=body.num_samples,
        include_usage=bool(body.stream) and body.include_usage,
        continuous_usage=bool(body.stream) and body.continuous_usage,
        echo_logprobs=body.logprobs if body.echo else None,
        prompt_logprobs=body.prompt_logprobs,
        token_ids=bool(body.return_tokens_as_token_ids),
    )
    request_id = request.headers.get("x-request-id", "")
    protos = [body.to_proto(p, request_id=f"{request_id}-{k}" if request_id and k else request_id)
              for k, p in enumerate(prompts)]
    return await generate(request, state, "/v1/completions", protos, builder, bool(body.stream),
                          recorded=body.recorded_fields(), fields=body.engine_fields())


async def prompt_text(prompt: Any, request: Request, state: BridgeState) -> str:
    """A prompt as text: itself, or its token ids detokenized by the engine (`echo`).
    Raises ApiError when the Detokenize call fails."""
    if isinstance(prompt, str):
        return prompt
    try:
        reply = await state.connect().generate.Detokenize(pb.DetokenizeRequest(tokens=prompt),
                                                          metadata=auth_metadata(request), timeout=30)
    except grpc.aio.AioRpcError as err:
        error = from_grpc(err)
        if error.param == "tokens":
            error.param = "prompt"
        raise error from None
    return reply.text
