"""POST /v1/completions: its handler (`completions`), and GenerateResponse messages -> SSE events
and OpenAI completion JSON (`CompletionBuilder`); the request body is
`bridge.protocol.CompletionRequest`.

One `CompletionBuilder` follows one Generate stream. Each message gives at most
one event; the builder also accumulates the whole completion for stream=false.

A token event is at once the design's event `{request_id, index, text, token_id,
logprob?}` and an OpenAI completion chunk (`id`, `object`, `created`, `model`,
`choices`), so the `openai` SDK can stream from the bridge.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Request
from fastapi.responses import Response

from bridge.protocol import FINISH_REASON_NAME, CompletionRequest, timing_json, timing_ms
from bridge.serving import generate
from bridge.state import BridgeState, bridge_state
from genserve.v1 import generate_pb2 as pb


@dataclass(slots=True)
class _Sample:
    """What one sample (one choice) has produced so far."""

    text: list[str] = field(default_factory=list)
    text_offset: int = 0
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float]] = field(default_factory=list)
    text_offsets: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    detail: str = ""
    completion_tokens: int = 0
    timing: pb.Timing | None = None


class CompletionBuilder:
    """Turns the messages of one Generate stream into events and a completion."""

    def __init__(self, *, model: str, created: int, num_samples: int, logprobs: bool) -> None:
        self.model = model
        self.created = created
        self.num_samples = num_samples
        self.logprobs = logprobs  # whether the client asked for logprobs
        self.request_id = ""
        self.prompt_tokens = 0
        self._samples: dict[int, _Sample] = {}
        self._finished: set[int] = set()

    @property
    def all_finished(self) -> bool:
        """Whether every one of the n samples has sent its Finished message."""
        return len(self._finished) >= self.num_samples

    def _sample(self, index: int) -> _Sample:
        return self._samples.setdefault(index, _Sample())

    def _chunk(self, index: int, text: str, logprobs: dict | None, finish_reason: str | None) -> dict:
        return {
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

    def events_for(self, msg: pb.GenerateResponse) -> list[dict]:
        """Record one message; return the SSE events it makes (none for Started, else one)."""
        event = self.on_message(msg)
        return [] if event is None else [event]

    def on_message(self, msg: pb.GenerateResponse) -> dict | None:
        """Record one message; return the SSE event it makes (None for Started)."""
        if msg.request_id:
            self.request_id = msg.request_id
        kind = msg.WhichOneof("event")
        if kind == "started":
            self.request_id = msg.started.request_id or self.request_id
            self.prompt_tokens = msg.started.prompt_tokens
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
            top = {t.text: t.logprob for t in tok.top_logprobs}
            logprobs = {
                "tokens": [tok.text],
                "token_logprobs": [tok.logprob],
                "top_logprobs": [top],
                "text_offset": [sample.text_offset],
            }
            sample.tokens.append(tok.text)
            sample.token_logprobs.append(tok.logprob)
            sample.top_logprobs.append(top)
            sample.text_offsets.append(sample.text_offset)
        sample.text_offset += len(tok.text)
        event = self._chunk(tok.index, tok.text, logprobs, None)
        event["text"] = tok.text
        event["token_id"] = tok.token_id
        event["position"] = tok.position
        if tok.HasField("logprob"):
            event["logprob"] = tok.logprob
        return event

    def _on_finished(self, fin: pb.Finished) -> dict:
        sample = self._sample(fin.index)
        self._finished.add(fin.index)
        reason = FINISH_REASON_NAME.get(fin.reason)
        sample.finish_reason = reason
        sample.detail = fin.detail
        sample.completion_tokens = fin.usage.completion_tokens if fin.HasField("usage") else sample.completion_tokens
        sample.timing = fin.timing
        prompt_tokens = fin.usage.prompt_tokens if fin.HasField("usage") else self.prompt_tokens
        event = self._chunk(fin.index, "", None, reason)
        event["finish_reason"] = reason
        event["usage"] = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": sample.completion_tokens,
            "total_tokens": prompt_tokens + sample.completion_tokens,
        }
        event["timing"] = timing_json(fin.timing)
        if fin.detail:
            event["detail"] = fin.detail
        return event

    def completion(self) -> dict:
        """The whole completion, OpenAI-style (for stream=false)."""
        choices = []
        for index in sorted(self._samples):
            sample = self._samples[index]
            choice = {
                "index": index,
                "text": "".join(sample.text),
                "logprobs": None,
                "finish_reason": sample.finish_reason,
            }
            if self.logprobs:
                choice["logprobs"] = {
                    "tokens": sample.tokens,
                    "token_logprobs": sample.token_logprobs,
                    "top_logprobs": sample.top_logprobs,
                    "text_offset": sample.text_offsets,
                }
            if sample.detail:
                choice["detail"] = sample.detail
            choices.append(choice)
        completion_tokens = sum(s.completion_tokens for s in self._samples.values())
        timings = [s.timing for s in self._samples.values() if s.timing is not None]
        timing = None
        if timings:
            timing = timing_ms(max(t.queue_ms for t in timings), min(t.ttft_ms for t in timings),
                               max(t.e2e_ms for t in timings))
        return {
            "id": self.request_id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": {
                "prompt_tokens": self.prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": self.prompt_tokens + completion_tokens,
            },
            "timing": timing,
            "request_id": self.request_id,
        }


async def completions(body: CompletionRequest, request: Request,
                      state: Annotated[BridgeState, Depends(bridge_state)]) -> Response:
    """POST /v1/completions: one Generate call, answered as JSON or (`stream`) as SSE.

    Raises ApiError: the Generate call failed before it started (its status mapped by
    `bridge.errors.from_grpc`), or, without `stream`, while it ran.
    """
    builder = CompletionBuilder(
        model=state.model_name,      # the model that answers, whatever `model` the body named
        created=int(time.time()),
        num_samples=body.num_samples,
        logprobs=body.logprobs is not None,
    )
    proto = body.to_proto(request_id=request.headers.get("x-request-id", ""))
    return await generate(request, state, "/v1/completions", proto, builder, bool(body.stream))
