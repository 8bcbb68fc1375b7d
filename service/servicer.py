"""The gRPC servicer: authenticate, validate, submit, stream tokens back, cancel on disconnect.

Failure and shutdown:

* While the engine loads, `Generate` and `Info` answer UNAVAILABLE ("engine is loading").
* When the engine loop fails, every open stream receives its ERROR event and ends with status
  UNAVAILABLE and the failure's message; new requests get UNAVAILABLE too.
* While draining (SIGTERM), new requests get UNAVAILABLE; open streams go on until they finish
  or `abort_all` ends them. Every UNAVAILABLE carries `retry-after` trailing metadata.
* Each request's output buffer holds at most `max_buffered_events` events (token ids waiting for
  the stream to send them). A client that reads so slowly that the buffer fills has its request
  cancelled in the engine and its stream ended with RESOURCE_EXHAUSTED, so a slow reader costs
  at most that many events of memory here (gRPC's own flow-control window bounds the rest).

Traces and logs: each Generate call is one span ("genserve.v1.GenerateService/Generate"), a child
of the caller's span when the metadata carries a W3C `traceparent` (the bridge sends one), with
events queued, admitted, preempted, first_token and finished (`service.tracing` adds the
scheduler's). Log lines of a call carry its request id; each finished sample logs one line.

Load reports: every Generate answer from a loaded engine ends with this replica's ORCA load report
(`service.load_report`: utilization, requests/s, free KV blocks, queued device-seconds) in its
trailing metadata, refusals included (a 429 says most about load), for Envoy's client-side
weighted round robin.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import socket
import time
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import NoReturn

import grpc
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from engine.core.engine import Engine, EngineUnavailable
from engine.core.outputs import FinishReason, TokenEvent
from engine.core.request import LoraRequest, Request
from engine.core.sched.admission import AdmissionRejected
from engine.core.snapshot import LatencySummary, SchedulerSnapshot, SnapshotSource
from engine.structured.compiler import GrammarCompiler
from engine.structured.spec import ConstraintError
from genserve.common.telemetry import REQUEST_ID, extract_metadata
from genserve.v1 import generate_pb2 as pb, generate_pb2_grpc as pb_grpc
from service.auth import ANONYMOUS, Authenticator
from service.handoff import LoopHandoff
from service.load_report import HEADER as LOAD_REPORT_HEADER, Load, LoadReporter
from service.metrics import EngineMetrics
from service.stream import SampleStream, TextOptions
from service.tracing import SpanTracker
from service.validation import ValidationError, Validator

log = logging.getLogger(__name__)

# Events one request may have waiting for its stream: at ~20 tokens/s per row that is ~25 s of
# output a client has not taken; each event is a small Python object (≈ 200 bytes).
MAX_BUFFERED_EVENTS = 512
# Seconds a client should wait before retrying an UNAVAILABLE (engine loading, draining, failed).
RETRY_AFTER_UNAVAILABLE_S = 1
# Trailing metadata of an INVALID_ARGUMENT naming the offending request field (generate.proto).
INVALID_FIELD_METADATA = "invalid-field"
ERROR_CODE_METADATA = "error-code"      # a precise error code the bridge answers with (generate.proto)
GENERATE_SPAN = "genserve.v1.GenerateService/Generate"
# WatchScheduler: milliseconds between snapshots by default and the range a caller may ask for.
WATCH_INTERVAL_MS = 250
WATCH_INTERVAL_RANGE_MS = (100, 10_000)
# Threads compiling constraints (engine/structured/compiler.py): a slow grammar holds one of them
# and no engine row; cached grammars need none.
COMPILE_THREADS = 2
# How much nicer than the engine the compile threads run (Linux: nice is per thread): while a big
# grammar compiles, the engine's step threads get the CPU first (the kernel's CFS weights for a
# difference of 10: ≈ 10 to 1), so other requests' tokens keep their pace instead of sharing the
# cores with the compiler.
COMPILE_NICE_OFFSET = 10


def _lower_compile_priority() -> None:
    """Compile-thread initializer: this thread's nice value becomes the process's plus
    COMPILE_NICE_OFFSET (at most 19), relative so that a server started niced keeps its compile
    threads below its own step threads, never above them (a privileged process could otherwise
    raise them). A no-op where the OS does not set priorities per thread or refuses."""
    try:
        tid = threading.get_native_id()
        own = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, own + COMPILE_NICE_OFFSET))
    except (AttributeError, OSError):
        pass


class StreamFailed(Exception):
    """A stream must end with this status (buffer overflow, drain timeout)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class EventBuffer:
    """One request's TokenEvents on their way from the scheduler thread to its gRPC stream.

    `put` is called on the event loop (the scheduler thread hops over through a
    `LoopHandoff`) and never blocks: it refuses an event once `limit` are waiting.
    `fail` makes the next `get` raise `StreamFailed`, ahead of any buffered events.
    """

    def __init__(self, limit: int = MAX_BUFFERED_EVENTS) -> None:
        self.limit = limit
        self.failure: StreamFailed | None = None
        self._items: deque[TokenEvent] = deque()
        self._ready = asyncio.Event()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, ev: TokenEvent) -> bool:
        """Queue `ev`; False when `limit` events are already waiting (the event is dropped)."""
        if len(self._items) >= self.limit:
            return False
        self._items.append(ev)
        self._ready.set()
        return True

    def fail(self, code: grpc.StatusCode, message: str) -> None:
        """End the stream with `code` at its next `get` (the first failure wins)."""
        if self.failure is None:
            self.failure = StreamFailed(code, message)
        self._ready.set()

    async def get(self) -> TokenEvent:
        """The next event; raises `StreamFailed` once `fail` was called."""
        while True:
            if self.failure is not None:
                raise self.failure
            if self._items:
                return self._items.popleft()
            self._ready.clear()
            await self._ready.wait()


class GenerateServicer(pb_grpc.GenerateServiceServicer):
    """`genserve.v1.GenerateService` over one engine.

    Args:
        engine: the running engine, or None while it loads (then see `attach`).
        tokenizer: encodes prompts; `token_bytes`/`is_special` for detokenization.
        validator: field and limit checks.
        auth: maps the `authorization` metadata to an API key (or rejects it).
        info: the `InfoResponse` to answer `Info` with.
        metrics: counts rejections by code (optional).
        max_buffered_events: bound of each request's output buffer (see the module doc).
        tracer: OpenTelemetry tracer (default: the global provider's; a no-op unless tracing
            was set up, see `genserve.common.telemetry`).

    The engine's scheduler thread hands each `TokenEvent` to the loop through a `LoopHandoff`,
    flushed by a step listener after each step's events (one loop wake-up per step), so token ids
    reach the request's buffer without the loop ever waiting on this server.
    """

    def __init__(self, engine: Engine | None = None, tokenizer=None, validator: Validator | None = None,
                 auth: Authenticator | None = None, info: pb.InfoResponse | None = None,
                 metrics: EngineMetrics | None = None, *,
                 max_buffered_events: int = MAX_BUFFERED_EVENTS,
                 tracer: trace.Tracer | None = None) -> None:
        self.auth = auth or Authenticator()
        self.tracer = tracer or trace.get_tracer("genserve.service")
        self.max_buffered_events = max_buffered_events
        self.draining = False
        self._open: set[EventBuffer] = set()
        self._handoff: LoopHandoff | None = None
        self._idle = asyncio.Event()
        self._idle.set()
        self.engine: Engine | None = None
        self.metrics: EngineMetrics | None = None
        self.snapshots: SnapshotSource | None = None
        self.load = LoadReporter()     # counts ended requests; writes the ORCA load reports
        self.num_watching = 0          # WatchScheduler streams open now
        # The LoRA adapters served by name (engine.runner.lora.LoraRegistry), set by the server
        # once the model has loaded; None: no adapter can be served. `lora_enabled`: the server
        # was started to serve adapters (--enable-lora, --lora-modules); see `serves_adapters`.
        self.adapters = None
        self.lora_enabled = False
        # Names of adapters unloaded at run time (and not loaded again): a request naming one is
        # NOT_FOUND even when no adapter is served any more, never silently the base model.
        self.unloaded_adapters: set[str] = set()
        self.adapter_loaded_s: dict[str, int] = {}
        # Names this process in scheduler snapshots; the server adds its port once bound.
        self.engine_label = f"{socket.gethostname()} pid {os.getpid()}"
        if engine is not None:
            self.attach(engine, tokenizer, validator, info, metrics)

    def attach(self, engine: Engine, tokenizer, validator: Validator, info: pb.InfoResponse,
               metrics: EngineMetrics | None = None) -> None:
        """Start serving `engine` (called once it has loaded)."""
        self.tokenizer = tokenizer
        self.validator = validator
        self.info = info
        self.metrics = metrics
        self.spans = SpanTracker(engine)
        self.snapshots = SnapshotSource(engine)
        self.grammars = GrammarCompiler(tokenizer)
        self._compile_pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="genserve-compile",
                                                initializer=_lower_compile_priority)
        self.engine = engine
        engine.step_listeners.append(self._flush_events)

    def _flush_events(self, _plan, _events, _step_s) -> None:
        """Step listener (scheduler thread): the step's events were queued; wake the loop once."""
        handoff = self._handoff
        if handoff is not None:
            handoff.flush()

    @property
    def num_open(self) -> int:
        """Generate streams in progress."""
        return len(self._open)

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no stream is open; False if `timeout_s` passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except TimeoutError:
            return False

    def abort_all(self, code: grpc.StatusCode, message: str) -> int:
        """End every open stream with `code` (their requests are cancelled). Returns how many."""
        for buffer in list(self._open):
            buffer.fail(code, message)
        return len(self._open)

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        span = self.tracer.start_span(GENERATE_SPAN, context=extract_metadata(context.invocation_metadata()),
                                      kind=SpanKind.SERVER)
        try:
            async with contextlib.aclosing(self._generate(request, context, span)) as messages:
                async for msg in messages:
                    yield msg
        except asyncio.CancelledError:
            span.add_event("client_cancelled")
            raise
        finally:
            span.end()

    async def _generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext,
                        span: trace.Span):
        api_key = await self._authenticate(context, span)
        if self.engine is None:
            await self._unavailable(context, "engine is loading; retry shortly", span)
        if self.draining:
            await self._unavailable(context, "server is draining (shutting down); retry on another replica", span)
        try:
            valid = self.validator.validate(request)
        except ValidationError as exc:
            context.set_trailing_metadata(((INVALID_FIELD_METADATA, exc.field),))
            await self._reject(context, "400", grpc.StatusCode.INVALID_ARGUMENT, str(exc), span)
        compiled = None
        if valid.constraint is not None:
            # Compiled off the event loop and the step loop; the request is not queued until then.
            if not self.grammars.cached(valid.constraint):
                span.add_event("compiling_constraint")
            try:
                compiled = await asyncio.get_running_loop().run_in_executor(
                    self._compile_pool, self.grammars.compile, valid.constraint)
            except ConstraintError as exc:
                context.set_trailing_metadata(((INVALID_FIELD_METADATA, exc.field),))
                await self._reject(context, "400", grpc.StatusCode.INVALID_ARGUMENT, str(exc), span)
        try:
            lora = self.lora_for(request.lora, api_key)
        except LookupError:
            await self._model_not_found(context, request.lora or self.auth.policy(api_key).default_adapter, span)
        request_id = request.request_id or f"cmpl-{uuid.uuid4().hex}"
        REQUEST_ID.set(request_id)
        span.set_attributes({"genserve.request_id": request_id, "genserve.prompt_tokens": len(valid.prompt_ids),
                             "genserve.max_tokens": valid.max_tokens, "genserve.n": valid.n})
        loop = asyncio.get_running_loop()
        if self._handoff is None or self._handoff.loop is not loop:
            self._handoff = LoopHandoff(loop)
        handoff = self._handoff
        buffer = EventBuffer(self.max_buffered_events)
        req = Request(
            request_id=request_id, api_key=api_key, prompt_ids=valid.prompt_ids,
            max_tokens=valid.max_tokens, sampling=valid.sampling, arrival_s=0.0,
            deadline_s=0.0, eos_token_id=self.tokenizer.eos_token_id, cache_salt=valid.cache_salt,
            on_event=lambda ev: handoff.call(self._deliver, request_id, buffer, ev), constraint=compiled,
            lora=lora)
        if valid.n > 1:
            req.fork(valid.n, sample_seeds(valid.sampling.seed, valid.n))
        if valid.deadline_s is not None:
            req.deadline_s = self.engine.clock() + valid.deadline_s
        self.spans.track(req, span)
        try:
            self.engine.submit(req)
        except AdmissionRejected as exc:
            self.spans.untrack(req)
            context.set_trailing_metadata((("retry-after", str(exc.retry_after_s)),))
            await self._reject(context, "429", grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc), span)
        except EngineUnavailable as exc:
            self.spans.untrack(req)
            await self._unavailable(context, str(exc), span)
        except ValueError as exc:
            self.spans.untrack(req)
            context.set_trailing_metadata(((INVALID_FIELD_METADATA, "request_id"),))
            await self._reject(context, "400", grpc.StatusCode.INVALID_ARGUMENT, f"request_id: {exc}", span)
        span.add_event("queued")
        if lora is not None and self.metrics is not None:
            self.metrics.lora_requests.labels(lora.name).inc()
        admitted_s = self.load.clock()

        self._open.add(buffer)
        self._idle.clear()
        open_samples = valid.n
        first_token = True
        try:
            yield pb.GenerateResponse(request_id=request_id, started=pb.Started(
                request_id=request_id, prompt_tokens=len(valid.prompt_ids),
                lora=lora.name if lora is not None else ""))
            options = TextOptions(valid.stop, valid.include_stop_str_in_output,
                                  valid.skip_special_tokens, valid.sampling.min_tokens)
            streams = [SampleStream(i, self.tokenizer, options, request.HasField("logprobs"))
                       for i in range(valid.n)]
            while open_samples:
                try:
                    ev = await buffer.get()
                except StreamFailed as exc:
                    await self._abort(context, exc.code, exc.message, span)
                if ev.finish_reason == FinishReason.ERROR:
                    log.error("request %s: %s", request_id, ev.finish_detail)
                    await self._abort(context, grpc.StatusCode.UNAVAILABLE, ev.finish_detail, span)
                if ev.prompt_logprobs is not None:
                    yield pb.GenerateResponse(request_id=request_id, prompt_logprobs=streams[
                        ev.index].prompt_logprobs(ev, valid.prompt_ids))
                    continue
                if first_token and ev.token_id is not None:
                    first_token = False
                    span.add_event("first_token", {"genserve.index": ev.index})
                out = streams[ev.index].on_event(ev)
                if out.stop_engine:
                    self.engine.stop_sample(request_id, ev.index)
                for msg in out.messages:
                    if isinstance(msg, pb.Token):
                        yield pb.GenerateResponse(request_id=request_id, token=msg)
                    else:
                        open_samples -= 1
                        self._finished(span, request_id, msg)
                        yield pb.GenerateResponse(request_id=request_id, finished=msg)
        finally:
            self.spans.untrack(req)
            self._open.discard(buffer)
            if not self._open:
                self._idle.set()
            self.load.request_ended(self.load.clock() - admitted_s, valid.n)
            if open_samples:
                # The client went away (disconnect or cancelled call), or the stream failed:
                # stop spending device time.
                self.engine.cancel(request_id)
            else:
                # Every sample finished: the status (OK) goes out once this generator returns,
                # with these trailers. (A failed stream's report went out with its abort.)
                self._add_load_report(context)

    @staticmethod
    def _finished(span: trace.Span, request_id: str, msg: pb.Finished) -> None:
        """One sample ended: a span event and one log line."""
        reason = pb.FinishReason.Name(msg.reason).removeprefix("FINISH_REASON_").lower()
        fields = {"index": msg.index, "finish_reason": reason, "detail": msg.detail,
                  "prompt_tokens": msg.usage.prompt_tokens, "completion_tokens": msg.usage.completion_tokens,
                  "queue_ms": round(msg.timing.queue_ms, 2), "e2e_ms": round(msg.timing.e2e_ms, 2)}
        if msg.timing.HasField("ttft_ms"):     # absent: the sample ended before its first token
            fields["ttft_ms"] = round(msg.timing.ttft_ms, 2)
        span.add_event("finished", {f"genserve.{k}": v for k, v in fields.items()})
        span_context = span.get_span_context()
        if span_context.is_valid:
            fields["trace_id"] = format(span_context.trace_id, "032x")
        log.info("request finished", extra={"request_id": request_id, **fields})

    def _deliver(self, request_id: str, buffer: EventBuffer, ev: TokenEvent) -> None:
        """On the event loop: queue `ev`, or cancel the request when its buffer is full."""
        if buffer.failure is not None or buffer.put(ev):
            return
        log.warning("request %s: output buffer full (%d events); cancelling it", request_id, buffer.limit)
        buffer.fail(grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"output buffer full: the client fell {buffer.limit} events behind; request cancelled")
        if self.metrics is not None:
            self.metrics.buffer_overflows.inc()
        self.engine.cancel(request_id)

    async def Cancel(self, request: pb.CancelRequest, context: grpc.aio.ServicerContext):
        api_key = await self._authenticate(context)
        REQUEST_ID.set(request.request_id)
        if self.engine is None:
            await self._unavailable(context, "engine is loading; retry shortly")
        if not self.engine.cancel(request.request_id, api_key=api_key):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"request_id: no running request {request.request_id!r}")
        return pb.CancelResponse(request_id=request.request_id)

    def lora_for(self, name: str, api_key: str) -> LoraRequest | None:
        """The adapter a Generate call runs on: `name` (the request's `lora`), or, when it is
        empty or the served model's name, the key's default adapter; None for the base model.

        Raises:
            LookupError: adapters are served and the name is neither the base model nor an
                adapter the key may use that is loaded (the same answer for both: a key learns
                nothing of another key's adapters).
        """
        policy = self.auth.policy(api_key)
        if not name or name == self.info.model_name:
            name = policy.default_adapter
        if not name or self.adapters is None:
            return None
        if not self.serves_adapters() and name not in self.unloaded_adapters:
            return None                    # the base model (LoRA off: any other name is the base)
        if not policy.allows(name):
            raise LookupError(name)
        try:
            return self.adapters.request(name)
        except KeyError:
            raise LookupError(name) from None

    def serves_adapters(self) -> bool:
        """Whether a request's model name picks an adapter: the server was started to serve them
        (`lora_enabled`), or an adapter loaded at run time is still loaded. Then a name that is
        neither the base model nor a loaded adapter is NOT_FOUND; otherwise any name is the base
        model (as before adapters) except an unloaded adapter's, which stays NOT_FOUND."""
        return self.adapters is not None and (self.lora_enabled or bool(self.adapters.adapters()))

    async def _model_not_found(self, context: grpc.aio.ServicerContext, name: str,
                               span: trace.Span | None = None) -> NoReturn:
        context.set_trailing_metadata(((INVALID_FIELD_METADATA, "lora"), (ERROR_CODE_METADATA, "model_not_found")))
        await self._reject(context, "404", grpc.StatusCode.NOT_FOUND, f"The model `{name}` does not exist.", span)

    async def ListModels(self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext):
        """The served model, then the loaded adapters the caller's key may use (with their parent)."""
        api_key = await self._authenticate(context)
        if self.engine is None:
            await self._unavailable(context, "engine is loading; retry shortly")
        base = self.info.model_name
        cards = [pb.ModelCard(id=base, created=self.adapter_loaded_s.get("", 0))]
        if self.serves_adapters():
            policy = self.auth.policy(api_key)
            cards += [pb.ModelCard(id=a.name, parent=base, root=a.path, created=self.adapter_loaded_s.get(a.name, 0))
                      for a in self.adapters.adapters() if policy.allows(a.name)]
        return pb.ListModelsResponse(models=cards)

    async def _admin(self, context: grpc.aio.ServicerContext) -> None:
        """Authenticate an adapter load or unload: PERMISSION_DENIED unless an admin key."""
        api_key = await self._authenticate(context)
        if not self.auth.policy(api_key).admin:
            await self._abort(context, grpc.StatusCode.PERMISSION_DENIED,
                              "loading and unloading LoRA adapters needs an admin key (GENSERVE_ADMIN_KEYS)")
        if self.engine is None or self.adapters is None:
            await self._unavailable(context, "engine is loading; retry shortly")

    async def LoadLoraAdapter(self, request: pb.LoadLoraAdapterRequest, context: grpc.aio.ServicerContext):
        """Load a PEFT adapter directory as `lora_name` (admin keys); a bad directory or a name in
        use is INVALID_ARGUMENT naming the field, and nothing else changes."""
        await self._admin(context)
        name, path = request.lora_name.strip(), request.lora_path
        field, problem = None, None
        if not name:
            field, problem = "lora_name", "lora_name: is required"
        elif name == self.info.model_name or name in self.adapters:
            field, problem = "lora_name", f"lora_name: {name!r} is already served"
        elif not path:
            field, problem = "lora_path", "lora_path: is required"
        if problem is None:
            try:
                adapter = await asyncio.get_running_loop().run_in_executor(None, self.adapters.load, name, path)
            except ValueError as exc:
                field, problem = "lora_path", f"lora_path: {exc}"
        if problem is not None:
            context.set_trailing_metadata(((INVALID_FIELD_METADATA, field),))
            await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, problem)
        self.adapter_loaded_s[name] = int(time.time())
        self.unloaded_adapters.discard(name)
        log.info("LoRA adapter %r loaded from %s (rank %d, %s)", name, path, adapter.rank, ", ".join(adapter.targets))
        return pb.LoadLoraAdapterResponse(lora_name=name, rank=adapter.rank)

    async def UnloadLoraAdapter(self, request: pb.UnloadLoraAdapterRequest, context: grpc.aio.ServicerContext):
        """Stop serving `lora_name` to new requests (admin keys); running ones finish on it."""
        await self._admin(context)
        name = request.lora_name.strip()          # as LoadLoraAdapter reads it
        try:
            self.adapters.unload(name)
        except KeyError:
            await self._abort(context, grpc.StatusCode.NOT_FOUND, f"lora_name: no LoRA adapter {name!r} is loaded")
        self.adapter_loaded_s.pop(name, None)
        self.unloaded_adapters.add(name)
        log.info("LoRA adapter %r unloaded (running requests finish on it)", name)
        return pb.UnloadLoraAdapterResponse(lora_name=name)

    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext):
        if self.engine is None:
            await self._abort(context, grpc.StatusCode.UNAVAILABLE, "engine is loading; retry shortly")
        return self.info

    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext):
        """Token ids of a prompt or a conversation, as Generate would count them (any valid key)."""
        await self._authenticate(context)
        if self.engine is None:
            await self._unavailable(context, "engine is loading; retry shortly")
        which = request.WhichOneof("input")
        try:
            if which == "prompt":
                ids = self.validator.tokenize_prompt(request.prompt)
            elif which == "chat":
                ids = self.validator.tokenize_chat(request.chat)
            else:
                raise ValidationError("prompt", "one of prompt or chat is required")
        except ValidationError as exc:
            context.set_trailing_metadata(((INVALID_FIELD_METADATA, exc.field),))
            await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return pb.TokenizeResponse(tokens=ids, max_context=self.info.max_context)

    async def Detokenize(self, request: pb.DetokenizeRequest, context: grpc.aio.ServicerContext):
        """The text of token ids: each token's bytes joined, control tokens as their text."""
        await self._authenticate(context)
        if self.engine is None:
            await self._unavailable(context, "engine is loading; retry shortly")
        ids = list(request.tokens)
        try:
            self.validator.check_token_ids(ids, "tokens")
        except ValidationError as exc:
            context.set_trailing_metadata(((INVALID_FIELD_METADATA, exc.field),))
            await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        text = b"".join(self.tokenizer.token_bytes(t) for t in ids).decode("utf-8", errors="replace")
        return pb.DetokenizeResponse(text=text)

    async def WatchScheduler(self, request: pb.WatchSchedulerRequest, context: grpc.aio.ServicerContext):
        """Stream a `SchedulerSnapshot` every `interval_ms` until the caller cancels (any
        authenticated key may watch; a snapshot names keys by their configured names only).
        Refusals here are not generation requests: `genserve_requests_rejected` does not count them."""
        metadata = dict(context.invocation_metadata() or ())
        if self.auth.api_key(metadata.get("authorization")) is None:
            await self._abort(context, grpc.StatusCode.UNAUTHENTICATED, "authorization: missing or unknown API key")
        if self.engine is None:
            await self._abort(context, grpc.StatusCode.UNAVAILABLE, "engine is loading; retry shortly")
        interval_ms = request.interval_ms or WATCH_INTERVAL_MS
        low, high = WATCH_INTERVAL_RANGE_MS
        if not low <= interval_ms <= high:
            context.set_trailing_metadata(((INVALID_FIELD_METADATA, "interval_ms"),))
            await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                              f"interval_ms: must be between {low} and {high}, got {interval_ms}")
        self.num_watching += 1
        try:
            while True:
                yield pb.WatchSchedulerResponse(snapshot=self.snapshot_message(self.snapshots.snapshot()))
                await asyncio.sleep(interval_ms / 1000.0)
        finally:
            self.num_watching -= 1

    def snapshot_message(self, snap: SchedulerSnapshot) -> pb.SchedulerSnapshot:
        """`snap` as the contract's message: keys by their configured names, step ages relative
        to the snapshot (s), the Unix time now."""
        st = snap.state
        total = len(st.kv_block_states)
        return pb.SchedulerSnapshot(
            unix_time_s=time.time(), engine=self.engine_label, steps=st.steps,
            running_rows=st.running_rows, prefill_rows=st.prefill_rows, max_rows=st.max_rows,
            queues=[pb.KeyQueue(name=self._key_name(q.key), queued=q.queued, running=q.running)
                    for q in st.queues],
            queued_device_s=st.queued_device_s, queue_budget_s=st.queue_budget_s,
            kv_pool=pb.KvPool(block_size=st.block_size, total_blocks=total, free_blocks=st.kv_blocks_free,
                              used_blocks=total - st.kv_blocks_free - st.kv_blocks_cached,
                              cached_blocks=st.kv_blocks_cached,
                              block_states=st.kv_block_states),
            recent_steps=[pb.StepSample(age_s=max(0.0, snap.time_s - s.end_s), decode_rows=s.decode_rows,
                                        prefill_tokens=s.prefill_tokens, decode_ms=s.decode_ms,
                                        prefill_ms=s.prefill_ms) for s in snap.steps],
            ttft=_latency(snap.ttft), tpot=_latency(snap.tpot), max_token_gap=_latency(snap.max_gap),
            latency_window_s=snap.window_s, rejected_total=st.rejected_total,
            preemptions_total=st.preemptions_total, finished_total=st.finished_total,
            adapters=[pb.AdapterUse(name=n, running=r, queued=q) for n, r, q in st.adapters])

    def _key_name(self, key: str) -> str:
        """The configured name of API key `key` (snapshots never carry the key itself)."""
        return ANONYMOUS if key == ANONYMOUS else self.auth.keys.get(key, "unknown key")

    async def _authenticate(self, context: grpc.aio.ServicerContext, span: trace.Span | None = None) -> str:
        metadata = dict(context.invocation_metadata() or ())
        key = self.auth.api_key(metadata.get("authorization"))
        if key is None:
            await self._reject(context, "401", grpc.StatusCode.UNAUTHENTICATED,
                               "authorization: missing or unknown API key", span)
        return key

    async def _reject(self, context: grpc.aio.ServicerContext, code: str,
                      status: grpc.StatusCode, message: str, span: trace.Span | None = None) -> NoReturn:
        """Count the rejection under its HTTP-equivalent code and end the call (raises)."""
        if self.metrics is not None:
            self.metrics.rejected.labels(code).inc()
        await self._abort(context, status, message, span)

    async def _unavailable(self, context: grpc.aio.ServicerContext, message: str,
                           span: trace.Span | None = None) -> NoReturn:
        await self._reject(context, "503", grpc.StatusCode.UNAVAILABLE, message, span)

    async def _abort(self, context: grpc.aio.ServicerContext, status: grpc.StatusCode, message: str,
                     span: trace.Span | None = None) -> NoReturn:
        """End the call with `status` (raises); UNAVAILABLE carries `retry-after`. A Generate call
        (the one kind that passes its `span`) also carries the load report. Trailing metadata set
        before (`invalid-field`) is kept."""
        if span is not None:
            span.set_attribute("rpc.grpc.status_code", status.value[0])
            span.set_status(Status(StatusCode.ERROR, f"{status.name}: {message}"))
        if status == grpc.StatusCode.UNAVAILABLE:
            context.set_trailing_metadata((*(context.trailing_metadata() or ()),
                                           ("retry-after", str(RETRY_AFTER_UNAVAILABLE_S))))
        if span is not None:
            self._add_load_report(context)
        await context.abort(status, message)

    def _add_load_report(self, context: grpc.aio.ServicerContext) -> None:
        """Add this engine's load report (`service.load_report`) to the call's trailing metadata,
        after what is there already; nothing while the engine loads. Takes the engine lock for a
        moment (`Engine.stats`)."""
        if self.engine is None:
            return
        stats = self.engine.stats()
        config = self.engine.config
        load = Load(running_rows=stats.running_rows, max_rows=config.max_rows,
                    queued_device_s=stats.queued_device_s, queue_budget_s=config.queue_budget_s,
                    kv_blocks_free=stats.kv_blocks_free, kv_blocks_total=stats.kv_blocks_total)
        kept = tuple(m for m in (context.trailing_metadata() or ()) if m[0] != LOAD_REPORT_HEADER)
        context.set_trailing_metadata((*kept, self.load.header(load)))


def _latency(summary: LatencySummary) -> pb.LatencySummary:
    return pb.LatencySummary(count=summary.count, p50_ms=summary.p50_ms, p95_ms=summary.p95_ms,
                             max_ms=summary.max_ms)


def sample_seeds(seed: int | None, n: int) -> list[int | None]:
    """Per-sample seeds: sample 0 keeps `seed`; sample i > 0 gets seed + i × 0x9E3779B97F4A7C15
    (the 64-bit golden-ratio increment of splitmix64) mod 2^63, so samples differ from each
    other but repeat when the request is sent again. No seed: every sample draws its own."""
    if seed is None:
        return [None] * n
    return [(seed + i * 0x9E3779B97F4A7C15) % 2**63 for i in range(n)]
