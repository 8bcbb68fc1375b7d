"""The gRPC servicer: authenticate, validate, submit, stream tokens back, cancel on disconnect."""

from __future__ import annotations

import asyncio
import logging
import uuid

import grpc

from engine.loop import Engine, EngineUnavailable
from engine.request import FinishReason, Request
from engine.scheduler import AdmissionRejected
from engine.step import TokenEvent
from genserve.v1 import generate_pb2 as pb
from genserve.v1 import generate_pb2_grpc as pb_grpc
from service.auth import Authenticator
from service.stream import SampleStream
from service.metrics import EngineMetrics
from service.validation import ValidationError, Validator

log = logging.getLogger(__name__)



class GenerateServicer(pb_grpc.GenerateServiceServicer):
    """`genserve.v1.GenerateService` over one engine.

    Args:
        engine: the running engine.
        tokenizer: encodes prompts; `token_bytes`/`is_special` for detokenization.
        validator: field and limit checks.
        auth: maps the `authorization` metadata to an API key (or rejects it).
        info: the `InfoResponse` to answer `Info` with.
        metrics: counts rejections by code (optional).

    The engine's scheduler thread hands each `TokenEvent` to `loop.call_soon_threadsafe`, so
    token ids reach the request's asyncio queue without the loop ever waiting on this server.
    """

    def __init__(self, engine: Engine, tokenizer, validator: Validator, auth: Authenticator,
                 info: pb.InfoResponse, metrics: EngineMetrics | None = None) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.validator = validator
        self.auth = auth
        self.info = info
        self.metrics = metrics

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        api_key = await self._authenticate(context)
        try:
            valid = self.validator.validate(request)
        except ValidationError as exc:
            await self._reject(context, "400", grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        request_id = request.request_id or f"cmpl-{uuid.uuid4().hex}"
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[TokenEvent] = asyncio.Queue()
        req = Request(
            request_id=request_id, api_key=api_key, prompt_ids=valid.prompt_ids,
            max_tokens=valid.max_tokens, sampling=valid.sampling, arrival_s=0.0,
            deadline_s=0.0, eos_token_id=self.tokenizer.eos_token_id,
            on_event=lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev))
        if valid.n > 1:
            req.fork(valid.n, sample_seeds(valid.sampling.seed, valid.n))
        if valid.deadline_s is not None:
            req.deadline_s = self.engine.clock() + valid.deadline_s
        try:
            self.engine.submit(req)
        except AdmissionRejected as exc:
            context.set_trailing_metadata((("retry-after", str(exc.retry_after_s)),))
            await self._reject(context, "429", grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except EngineUnavailable as exc:
            await self._reject(context, "503", grpc.StatusCode.UNAVAILABLE, str(exc))
        except ValueError as exc:
            await self._reject(context, "400", grpc.StatusCode.INVALID_ARGUMENT, f"request_id: {exc}")

        open_samples = valid.n
        try:
            yield pb.GenerateResponse(request_id=request_id, started=pb.Started(
                request_id=request_id, prompt_tokens=len(valid.prompt_ids)))
            streams = [SampleStream(i, self.tokenizer, valid.stop, request.HasField("logprobs"))
                       for i in range(valid.n)]
            while open_samples:
                ev = await events.get()
                if ev.finish_reason == FinishReason.ERROR:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, ev.finish_detail)
                out = streams[ev.index].on_event(ev)
                if out.stop_engine:
                    self.engine.stop_sample(request_id, ev.index)
                for msg in out.messages:
                    if isinstance(msg, pb.Token):
                        yield pb.GenerateResponse(request_id=request_id, token=msg)
                    else:
                        open_samples -= 1
                        yield pb.GenerateResponse(request_id=request_id, finished=msg)
        finally:
            if open_samples:
                # The client went away (disconnect or cancelled call): stop spending device time.
                self.engine.cancel(request_id)

    async def Cancel(self, request: pb.CancelRequest, context: grpc.aio.ServicerContext):
        api_key = await self._authenticate(context)
        if not self.engine.cancel(request.request_id, api_key=api_key):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"request_id: no running request {request.request_id!r}")
        return pb.CancelResponse(request_id=request.request_id)

    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext):
        return self.info

    async def _authenticate(self, context: grpc.aio.ServicerContext) -> str:
        metadata = dict(context.invocation_metadata() or ())
        key = self.auth.api_key(metadata.get("authorization"))
        if key is None:
            await self._reject(context, "401", grpc.StatusCode.UNAUTHENTICATED,
                               "authorization: missing or unknown API key")
        return key

    async def _reject(self, context: grpc.aio.ServicerContext, code: str,
                      status: grpc.StatusCode, message: str) -> None:
        """Count the rejection under its HTTP-equivalent code and end the call (raises)."""
        if self.metrics is not None:
            self.metrics.rejected.labels(code).inc()
        await context.abort(status, message)


def sample_seeds(seed: int | None, n: int) -> list[int | None]:
    """Per-sample seeds: sample 0 keeps `seed`; sample i > 0 gets seed + i × 0x9E3779B97F4A7C15
    (the 64-bit golden-ratio increment of splitmix64) mod 2^63, so samples differ from each
    other but repeat when the request is sent again. No seed: every sample draws its own."""
    if seed is None:
        return [None] * n
    return [(seed + i * 0x9E3779B97F4A7C15) % 2**63 for i in range(n)]
