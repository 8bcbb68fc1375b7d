"""POST /v1/chat/completions: its handler (`chat_completions`) and the chat events
(`ChatCompletionBuilder`); the request body and its gRPC request are
`bridge.protocol.ChatCompletionRequest`.

OpenAI's chat API (what ``client.chat.completions.create`` sends and reads) on top of the same
Generate stream as /v1/completions: the messages travel to the engine, which renders them with
the model's chat template (service/chat.py) and tokenizes the result; each Token message becomes a
``chat.completion.chunk`` whose ``delta`` carries the new text, each Finished message a chunk with
the sample's ``finish_reason``. Sampling fields, ``n``, ``stop``, ``seed`` and the engine's limits
are those of completions; ``logprobs`` is a boolean with ``top_logprobs`` alternatives (0 to 5,
the engine's limit), reported in the chat shape ``{"content": [{token, logprob, bytes,
top_logprobs}]}``, where ``bytes`` are each token's own (a token may hold part of a character:
its ``token`` is then the text it completes, possibly empty, while the ``bytes`` of the entries,
joined, are the answer's bytes) and an alternative's ``token`` shows a partial character as
U+FFFD. ``max_completion_tokens`` is OpenAI's newer name for ``max_tokens``; without either, the
engine allows as many tokens as its limit and the context leave. A completion's id is
``chatcmpl-<hex>``, also its request id unless the client sent ``X-Request-Id``.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.responses import Response

from bridge.errors import ApiError
from bridge.protocol import (ChatCompletionRequest, FINISH_REASON_NAME, completion_timing, prompt_logprobs_json,
                             timing_json, token_label)
from bridge.serving import generate
from bridge.state import BridgeState, auth_metadata, bridge_state
from bridge.tools import GENERIC, ToolFormat
from genserve.common.chat_messages import ChatError
from genserve.v1 import generate_pb2 as pb

CHAT_ID_PREFIX = "chatcmpl-"


class ChatCompletionBuilder:
    """Turns the messages of one Generate stream into chat chunks and a chat completion.

    Args:
        model: the served model's name (every chunk names it).
        created: Unix time (s) of the request.
        num_samples: n.
        logprobs: whether the client asked for logprobs.
        include_usage: stream a last chunk with the usage (``stream_options.include_usage``).
        continuous_usage: every chunk of a choice carries its usage so far
            (``stream_options.continuous_usage_stats``, vLLM's).
        tools: the request has tools that may be called (`tool_choice` auto, required or named;
            never "none", whose answer is text): the served model's tool-call format
            (bridge/tools.py; True: the generic one). An answer that starts as calls do in it
            (``<``, ``{`` or ``[``) is held back until it ends and, when it is tool calls,
            answered as ``tool_calls`` (streamed: each call's id and name, then its arguments)
            with finish_reason "tool_calls".
        prompt_logprobs: vLLM's `prompt_logprobs` (alternatives per prompt token), reported on
            the whole completion (``prompt_logprobs``, vLLM's place for it); None: not asked.
        token_ids: vLLM's `return_tokens_as_token_ids`: each `logprobs` entry's ``token`` is
            ``token_id:<id>`` (its ``bytes`` stay the token's own).
    """

    def __init__(self, *, model: str, created: int, num_samples: int, logprobs: bool,
                 include_usage: bool = False, continuous_usage: bool = False,
                 tools: bool | ToolFormat = False,
                 prompt_logprobs: int | None = None, token_ids: bool = False) -> None:
        self.model = model
        self.created = created
        self.num_samples = num_samples
        self.logprobs = logprobs
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage
        self.request_id = ""
        self.prompt_tokens = 0
        self._text: dict[int, list[str]] = {i: [] for i in range(num_samples)}
        self._logprobs: dict[int, list[dict]] = {i: [] for i in range(num_samples)}
        self._finish: dict[int, str | None] = {}
        self._completion_tokens: dict[int, int] = {}
        self._detail: dict[int, str] = {}
        self._timing: dict[int, pb.Timing] = {}
        self.tools: ToolFormat | None = GENERIC if tools is True else (tools or None)
        self._calls: dict[int, list[dict]] = {}
        self._cached_tokens = 0
        self._opened: set[int] = set()       # choices whose role chunk went out
        self.prompt_logprobs = prompt_logprobs
        self.token_ids = token_ids
        self._prompt_logprobs: list[dict | None] | None = None

    @property
    def all_finished(self) -> bool:
        """Whether every one of the n samples has sent its Finished message."""
        return len(self._finish) >= self.num_samples

    @property
    def completion_id(self) -> str:
        """The chat completion's id: the request id when it has OpenAI's ``chatcmpl-`` prefix (the
        bridge's own ids do), else that prefix on it."""
        if self.request_id.startswith(CHAT_ID_PREFIX):
            return self.request_id
        return CHAT_ID_PREFIX + self.request_id

    def _chunk(self, choices: list[dict], **extra: Any) -> dict:
        chunk = {"id": self.completion_id, "object": "chat.completion.chunk",
                 "created": self.created, "model": self.model, "choices": choices,
                 "request_id": self.request_id, **extra}
        if self.continuous_usage and len(choices) == 1:
            chunk.setdefault("usage", self._choice_usage(choices[0]["index"]))
        if self.include_usage or self.continuous_usage:
            chunk.setdefault("usage", None)
        return chunk

    def _choice_usage(self, index: int) -> dict:
        completion = self._completion_tokens.get(index, len(self._text.get(index, ())))
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion}

    def _open(self, index: int) -> list[dict]:
        """The role chunk of choice `index` the first time it has something to say, else []."""
        if index in self._opened:
            return []
        self._opened.add(index)
        return [self._chunk([{"index": index, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}])]

    def events_for(self, msg: pb.GenerateResponse) -> list[dict]:
        """Record one message; return the chunks it makes. Started makes none: a choice's role
        chunk goes out with its first token (or its finish), as OpenAI's and vLLM's do, so a
        client timing the first chunk measures the time to the first token, not to admission."""
        if msg.request_id:
            self.request_id = msg.request_id
        kind = msg.WhichOneof("event")
        if kind == "started":
            self.request_id = msg.started.request_id or self.request_id
            self.prompt_tokens = msg.started.prompt_tokens
            self.model = msg.started.lora or self.model      # the adapter that answers
            return []
        if kind == "prompt_logprobs":
            if self.prompt_logprobs is not None:
                self._prompt_logprobs = prompt_logprobs_json(msg.prompt_logprobs, self.prompt_logprobs)
            return []
        if kind == "token":
            tok = msg.token
            self._text.setdefault(tok.index, []).append(tok.text)
            entry = None
            if tok.HasField("logprob"):
                # Each token's own bytes (an engine without them: its text's).
                entry = {"token": token_label(tok.token_id, tok.text, self.token_ids), "logprob": tok.logprob,
                         "bytes": list(tok.token_bytes or tok.text.encode()),
                         "top_logprobs": [{"token": token_label(t.token_id, t.text, self.token_ids),
                                           "logprob": t.logprob,
                                           "bytes": list(t.token_bytes or t.text.encode())}
                                          for t in tok.top_logprobs]}
                self._logprobs.setdefault(tok.index, []).append(entry)
            if self.tools and self.tools.may_be_calls("".join(self._text[tok.index])):
                return self._open(tok.index)                # maybe a tool call: held until the end
            return self._open(tok.index) + [self._chunk([{"index": tok.index, "delta": {"content": tok.text},
                                  "logprobs": None if entry is None else {"content": [entry]},
                                  "finish_reason": None}])]
        if kind == "finished":
            fin = msg.finished
            reason = FINISH_REASON_NAME.get(fin.reason)
            chunks = self._open(fin.index)          # the role chunk, if no token sent it
            text = "".join(self._text.get(fin.index, []))
            if self.tools and self.tools.may_be_calls(text):
                calls = self.tools.parse(text) if reason == "stop" else None
                if calls:
                    reason = "tool_calls"
                    self._calls[fin.index] = calls
                    for k, call in enumerate(calls):
                        head = {"index": k, "id": call["id"], "type": "function",
                                "function": {"name": call["function"]["name"], "arguments": ""}}
                        tail = {"index": k, "function": {"arguments": call["function"]["arguments"]}}
                        chunks += [self._chunk([{"index": fin.index, "delta": {"tool_calls": [part]},
                                                 "logprobs": None, "finish_reason": None}])
                                   for part in (head, tail)]
                else:
                    chunks.append(self._chunk([{"index": fin.index, "delta": {"content": text},
                                                "logprobs": None, "finish_reason": None}]))
            self._finish[fin.index] = reason
            if fin.HasField("usage"):
                self._completion_tokens[fin.index] = fin.usage.completion_tokens
                self.prompt_tokens = fin.usage.prompt_tokens or self.prompt_tokens
                self._cached_tokens = max(self._cached_tokens, fin.usage.cached_tokens)
            self._detail[fin.index] = fin.detail
            if fin.HasField("timing"):
                self._timing[fin.index] = fin.timing
            extra: dict[str, Any] = {"timing": timing_json(fin.timing)}
            if fin.detail:
                extra["detail"] = fin.detail
            chunks.append(self._chunk([{"index": fin.index, "delta": {}, "logprobs": None,
                                        "finish_reason": reason}], **extra))
            if self.include_usage and self.all_finished:
                chunks.append(self._chunk([], usage=self.usage()))
            return chunks
        return []

    def usage(self) -> dict:
        """Token counts over all samples, OpenAI's ``usage`` object (``prompt_tokens_details.
        cached_tokens``: the prompt tokens the prefix cache held)."""
        completion = sum(self._completion_tokens.get(i, len(t)) for i, t in self._text.items())
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion,
                "prompt_tokens_details": {"cached_tokens": self._cached_tokens}}

    def completion(self) -> dict:
        """The whole chat completion, OpenAI-style (for stream=false)."""
        choices = []
        for i in sorted(self._text):
            choice = {"index": i, "message": {"role": "assistant", "content": "".join(self._text[i])},
                      "logprobs": {"content": self._logprobs.get(i, [])} if self.logprobs else None,
                      "finish_reason": self._finish.get(i)}
            if i in self._calls:
                choice["message"] = {"role": "assistant", "content": None, "tool_calls": self._calls[i]}
                choice["finish_reason"] = "tool_calls"
            if self._detail.get(i):
                choice["detail"] = self._detail[i]
            choices.append(choice)
        out = {"id": self.completion_id, "object": "chat.completion", "created": self.created,
               "model": self.model, "choices": choices, "usage": self.usage(),
               "timing": completion_timing(self._timing.values()), "request_id": self.request_id}
        if self.prompt_logprobs is not None:
            out["prompt_logprobs"] = self._prompt_logprobs
        return out


async def chat_completions(body: ChatCompletionRequest, request: Request,
                           state: Annotated[BridgeState, Depends(bridge_state)]) -> Response:
    """POST /v1/chat/completions: one Generate call with the messages, answered as a
    `chat.completion` or (`stream`) as `chat.completion.chunk` SSE events (`ChatCompletionBuilder`).

    With tools, tool calls or tool results, the served model's tool-call format (the engine's
    Info, asked once: `BridgeState.tool_format`) decides how they are written and read.

    Raises ApiError: 400 naming the message field at fault (`messages[1].role`) or a field the
    policy refuses (bridge/fields.py), or as `bridge.completions.completions` does.
    """
    refused = body.policy_refusal()
    if refused is not None:
        raise ApiError(400, refused.message, code=refused.code, param=refused.field)
    if body.uses_tools():
        body.use_tool_format(await state.tool_format(auth_metadata(request)))
    request_id = request.headers.get("x-request-id") or f"{CHAT_ID_PREFIX}{uuid.uuid4().hex}"
    try:
        proto = body.to_proto(request_id=request_id)
    except ChatError as e:
        raise ApiError(400, str(e), code="invalid_argument", param=e.field) from None
    stream = bool(body.stream)
    builder = ChatCompletionBuilder(model=state.model_name, created=int(time.time()),
                                    num_samples=body.num_samples, logprobs=bool(body.logprobs),
                                    include_usage=stream and body.include_usage,
                                    continuous_usage=stream and body.continuous_usage,
                                    tools=body.tool_format if body.tool_setup() is not None else False,
                                    prompt_logprobs=body.prompt_logprobs,
                                    token_ids=bool(body.return_tokens_as_token_ids))
    return await generate(request, state, "/v1/chat/completions", proto, builder, stream,
                          recorded=body.recorded_fields(), fields=body.engine_fields())
