"""A fake GenerateService: a TEST DOUBLE for the bridge's translation logic.

It is not the real service and knows nothing of models. It streams a fixed
token list, records every request, its metadata and every cancellation, and
behaves according to the prompt text:

    "error:<CODE>"             abort with that gRPC status before Started
    "error:<CODE>:<seconds>"   ... with trailing metadata retry-after=<seconds>
    "error:<CODE>:<key>=<val>" ... with trailing metadata <key>=<val>
    "midstream-error:<CODE>"   Started, one token, then abort with that status
    "hang"                     Started, one token, then wait until cancelled
    "hang-before-token"        Started, then wait until cancelled
    "slow-first-token:<s>"     Started, then <s> seconds (a queued request), then as below
    "incomplete"               Started, one token, then end without Finished
    "reply:<text>"             <text> as tokens of at most 4 characters (one sample), then Finished
    anything else              TOKENS for each of the n samples, then Finished

`info` is what Info answers (a test sets its tool_call_parser to act as a model whose template
defines tool calls); `info_calls` counts the Info calls.

A chat request is scripted by its last message's content, and counts the words of all its
messages as prompt tokens.

Tokenize and Detokenize are byte-level: a text's UTF-8 bytes are its tokens (a conversation's is
its messages' contents joined by newlines); a token of 256 or more is INVALID_ARGUMENT naming
`tokens`.

"hang" requests can also be ended by the Cancel RPC: they then finish with
FINISH_REASON_CANCELLED. Cancel of an unknown id is NOT_FOUND.
"""

from __future__ import annotations

import asyncio
import itertools

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from genserve.v1 import generate_pb2 as pb
from genserve.v1 import generate_pb2_grpc as pb_grpc

# (text, token_id) of every fake completion.
TOKENS = [("Hello", 101), (",", 102), (" world", 103), ("!", 104)]
FULL_TEXT = "".join(text for text, _ in TOKENS)
TIMING = pb.Timing(queue_ms=1.5004321, ttft_ms=12.2500004, e2e_ms=40.0)   # the bridge rounds to µs
INFO = pb.InfoResponse(
    model_name="fake-model", max_context=8192, max_new_tokens=1000,
    vocab_size=49152, block_size=16, num_kv_blocks=7152,
)


def prompt_tokens_of(request: pb.GenerateRequest) -> int:
    if request.WhichOneof("prompt_input") == "prompt_token_ids":
        return len(request.prompt_token_ids.ids)
    if request.WhichOneof("prompt_input") == "chat":
        return sum(len(m.content.split()) for m in request.chat.messages)
    return len(request.prompt.split())


class FakeGenerateService(pb_grpc.GenerateServiceServicer):
    """Records what the bridge sends; answers with scripted streams (see module doc)."""

    def __init__(self) -> None:
        self.requests: list[pb.GenerateRequest] = []
        self.metadata: list[dict[str, str]] = []
        self.cancel_calls: list[tuple[str, dict[str, str]]] = []
        # request ids whose Generate call the client cancelled (context cancelled).
        self.cancelled_calls: list[str] = []
        self.call_cancelled = asyncio.Event()
        self.hanging = asyncio.Event()  # set when a "hang" request is waiting
        self._cancel_flags: dict[str, asyncio.Event] = {}
        self._ids = itertools.count(1)
        self.info = pb.InfoResponse()
        self.info.CopyFrom(INFO)
        self.info_calls = 0

    async def Generate(self, request, context):
        self.requests.append(request)
        self.metadata.append(dict(context.invocation_metadata()))
        prompt = (request.chat.messages[-1].content
                  if request.WhichOneof("prompt_input") == "chat" and request.chat.messages
                  else request.prompt)
        if prompt.startswith("error:"):
            _, code, *extra = prompt.split(":")
            trailing = ()
            if extra:
                key, _, value = extra[0].rpartition("=")
                trailing = ((key or "retry-after", value),)
            await context.abort(grpc.StatusCode[code], f"fake {code}", trailing_metadata=trailing)
        request_id = request.request_id or f"fake-{next(self._ids)}"
        cancel_flag = self._cancel_flags[request_id] = asyncio.Event()
        num_prompt = prompt_tokens_of(request)
        try:
            if prompt == "hang-before-started":      # admitted late: Started only once cancelled
                self.hanging.set()
                await cancel_flag.wait()
                yield pb.GenerateResponse(
                    request_id=request_id, started=pb.Started(request_id=request_id, prompt_tokens=num_prompt))
                yield self._finished(request_id, 0, pb.FINISH_REASON_CANCELLED, num_prompt, 0, "cancel")
                return
            yield pb.GenerateResponse(
                request_id=request_id,
                started=pb.Started(request_id=request_id, prompt_tokens=num_prompt),
            )
            if prompt.startswith("slow-first-token:"):    # queued this long before its tokens
                await asyncio.sleep(float(prompt.split(":")[1]))
            if prompt == "hang-before-token":
                self.hanging.set()
                await cancel_flag.wait()
                yield self._finished(request_id, 0, pb.FINISH_REASON_CANCELLED, num_prompt, 0, "cancel")
                return
            if prompt in ("hang", "incomplete") or prompt.startswith("midstream-error:"):
                yield self._token(request, request_id, 0, 0)
                if prompt == "incomplete":
                    return
                if prompt == "hang":
                    self.hanging.set()
                    await cancel_flag.wait()
                    yield self._finished(request_id, 0, pb.FINISH_REASON_CANCELLED, num_prompt, 1, "cancel")
                    return
                code = prompt.split(":")[1]
                await context.abort(grpc.StatusCode[code], f"fake mid-stream {code}")
            if prompt.startswith("reply:"):
                text = prompt[len("reply:"):]
                parts = [text[k:k + 4] for k in range(0, len(text), 4)]
                for position, part in enumerate(parts):
                    yield pb.GenerateResponse(request_id=request_id, token=pb.Token(
                        index=0, text=part, token_id=200 + position, position=position))
                yield self._finished(request_id, 0, pb.FINISH_REASON_STOP, num_prompt, len(parts), "")
                return
            n = request.n if request.HasField("n") else 1
            max_tokens = request.max_tokens if request.HasField("max_tokens") else 16
            num_tokens = min(max_tokens, len(TOKENS))
            reason = pb.FINISH_REASON_LENGTH if max_tokens < len(TOKENS) else pb.FINISH_REASON_STOP
            for position in range(num_tokens):
                for index in range(n):  # samples interleave, as in a batched engine
                    yield self._token(request, request_id, index, position)
            for index in range(n):
                yield self._finished(request_id, index, reason, num_prompt, num_tokens, "")
        except asyncio.CancelledError:
            self.cancelled_calls.append(request_id)
            self.call_cancelled.set()
            raise
        finally:
            self._cancel_flags.pop(request_id, None)

    @staticmethod
    def _token(request, request_id: str, index: int, position: int) -> pb.GenerateResponse:
        text, token_id = TOKENS[position]
        token = pb.Token(index=index, text=text, token_id=token_id, position=position)
        if request.HasField("logprobs"):
            token.logprob = -0.5 * (position + 1)
            for k in range(request.logprobs):
                token.top_logprobs.add(token_id=token_id + k, text=f"{text}#{k}", logprob=-0.5 * (position + 1) - k)
        return pb.GenerateResponse(request_id=request_id, token=token)

    @staticmethod
    def _finished(request_id, index, reason, num_prompt, num_completion, detail) -> pb.GenerateResponse:
        return pb.GenerateResponse(
            request_id=request_id,
            finished=pb.Finished(
                index=index, reason=reason, detail=detail,
                usage=pb.Usage(prompt_tokens=num_prompt, completion_tokens=num_completion),
                timing=TIMING,
            ),
        )

    async def Cancel(self, request, context):
        self.cancel_calls.append((request.request_id, dict(context.invocation_metadata())))
        flag = self._cancel_flags.get(request.request_id)
        if flag is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown request {request.request_id!r}")
        flag.set()
        return pb.CancelResponse(request_id=request.request_id)

    async def Info(self, request, context):
        self.info_calls += 1
        return self.info

    async def Tokenize(self, request, context):
        self.metadata.append(dict(context.invocation_metadata()))
        if request.WhichOneof("input") == "chat":
            text = "\n".join(m.content for m in request.chat.messages)
        else:
            text = request.prompt
        return pb.TokenizeResponse(tokens=list(text.encode()), max_context=INFO.max_context)

    async def Detokenize(self, request, context):
        self.metadata.append(dict(context.invocation_metadata()))
        if any(t >= 256 for t in request.tokens):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "tokens: outside the vocabulary",
                                trailing_metadata=(("invalid-field", "tokens"),))
        return pb.DetokenizeResponse(text=bytes(request.tokens).decode("utf-8", errors="replace"))


class FakeServer:
    """A grpc.aio server on a free localhost port running FakeGenerateService."""

    def __init__(self, *, with_health: bool = True) -> None:
        self.service = FakeGenerateService()
        self.health = health.aio.HealthServicer() if with_health else None
        self.server = grpc.aio.server()
        pb_grpc.add_GenerateServiceServicer_to_server(self.service, self.server)
        if self.health is not None:
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.target = f"127.0.0.1:{self.port}"

    async def start(self) -> None:
        await self.server.start()
        if self.health is not None:
            await self.set_serving(True)

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        await self.health.set("genserve.v1.GenerateService", status)

    async def stop(self) -> None:
        await self.server.stop(grace=None)
