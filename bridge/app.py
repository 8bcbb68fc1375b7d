"""The bridge's FastAPI app: OpenAI-style REST + SSE in front of gRPC GenerateService.

    POST   /v1/completions              -> Generate (server stream)
    POST   /v1/chat/completions         -> Generate with chat messages (server stream)
    DELETE /v1/requests/{request_id}    -> Cancel
    GET    /health                      -> grpc.health.v1 Check (or Info)
    GET    /v1/models                   -> the one served model
    GET    /metrics                     -> the bridge's and the engine's Prometheus metrics
    GET    /                            -> the web console (playground + live scheduler view)
    GET    /static/...                  -> the console's files (bridge/static/)
    GET    /v1/console/events           -> WatchScheduler (server stream), as SSE

A request body must be JSON (`application/json`, `+json`, or no content type: 415 otherwise),
UTF-8 (400) and at most `max_body_bytes` (1 MiB by default: 413), checked before parsing.

Each completion is one OpenTelemetry span ("POST /v1/completions") whose W3C trace context goes
to the engine in the gRPC metadata, so the engine's span joins the same trace (see
`genserve.common.telemetry`); events: started, first_token, finished (per sample), error.

The bridge only translates. It forwards `Authorization: Bearer <key>` as gRPC
metadata `authorization`, maps gRPC status codes to HTTP (errors.py), and turns
each GenerateResponse into one SSE event (events.py). A client that disconnects,
or reads nothing for `slow_client_timeout_s`, has its gRPC call cancelled, which
cancels the request in the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Annotated

import grpc
from fastapi import APIRouter, Depends, FastAPI, Query, Request
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from grpc_health.v1 import health_pb2, health_pb2_grpc
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from bridge.chat import ChatCompletionBuilder, ChatCompletionRequest
from bridge.console import INDEX_HTML, STATIC_DIR, snapshot_event
from bridge.errors import DEFAULT_RETRY_AFTER_S, ApiError, from_grpc
from bridge.events import SSE_DONE, SSE_KEEPALIVE, Builder, CompletionBuilder, sse_data, sse_error
from bridge.metrics import BridgeMetrics
from bridge.schemas import UINT32_MAX, CompletionRequest
from genserve.common.chat_messages import ChatError
from genserve.common.model_name import DEFAULT_MODEL_NAME
from genserve.common.telemetry import REQUEST_ID, inject_metadata
from genserve.v1 import generate_pb2 as pb
from genserve.v1 import generate_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

# The name the service registers with grpc.health.v1 (falls back to Info if absent).
HEALTH_SERVICE_NAME = "genserve.v1.GenerateService"
HEALTH_TIMEOUT_S = 2.0
CANCEL_TIMEOUT_S = 5.0
# Cancel a client that reads nothing for 30 s (docs/design.md, "Fairness, cancellation and streaming").
SLOW_CLIENT_TIMEOUT_S = 30.0
# A queued stream's keep-alive comment interval, seconds (sse-starlette's default ping interval):
# far below Envoy's 300 s stream_idle_timeout (charts/genserve/values.yaml).
SSE_KEEPALIVE_S = 15.0
# Largest request body accepted (413 above). A full 8,192-token prompt is well under 100 KB.
MAX_BODY_BYTES = 1024 * 1024
# While the engine is down (restarting), calls fail at once with UNAVAILABLE (503 + Retry-After);
# the channel retries the connection at most this often, so the bridge recovers on its own
# within about a second of the engine coming back (gRPC's default back-off grows to 120 s).
CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
)


class _Backend:
    """The app's one gRPC channel and the stubs on it."""

    def __init__(self, target: str) -> None:
        self.channel = grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
        self.generate = pb_grpc.GenerateServiceStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    async def close(self) -> None:
        await self.channel.close()


def _auth_metadata(request: Request) -> tuple[tuple[str, str], ...]:
    """The caller's Authorization header as gRPC metadata (nothing if absent)."""
    value = request.headers.get("authorization")
    return (("authorization", value),) if value else ()


async def _wait_for_disconnect(receive: Receive) -> None:
    """Return once the client has gone (the ASGI server says http.disconnect)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


@contextlib.asynccontextmanager
async def _cancel_on_disconnect(request: Request, call: grpc.aio.Call) -> AsyncIterator[None]:
    """While inside, a client disconnect cancels `call` (for work done before the response starts)."""
    watcher = asyncio.create_task(_wait_for_disconnect(request.receive))
    watcher.add_done_callback(lambda t: t.cancelled() or call.cancel())
    try:
        yield
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher


def _read_cancelled_by_us() -> bool:
    """Whether a CancelledError came from a cancelled gRPC call, not from our task being cancelled."""
    task = asyncio.current_task()
    return task is None or task.cancelling() == 0


class SSEResponse(StreamingResponse):
    """A text/event-stream response bound to a gRPC call.

    Unlike Starlette's StreamingResponse it always listens for the client going
    away (whatever ASGI spec version the server speaks), and then, or when one
    write waits longer than `write_timeout_s` (a client that reads nothing),
    or on any other exit, it cancels the gRPC call.
    """

    media_type = "text/event-stream"

    def __init__(
        self,
        content: AsyncIterator[str],
        *,
        call: grpc.aio.Call,
        write_timeout_s: float,
        headers: dict[str, str] | None = None,
        span: trace.Span | None = None,
    ) -> None:
        super().__init__(content, headers=headers)
        self._call = call
        self._write_timeout_s = write_timeout_s
        self._span = span

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        listener = asyncio.create_task(_wait_for_disconnect(receive))
        listener.add_done_callback(lambda t: t.cancelled() or self._call.cancel())
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            loop = asyncio.get_running_loop()
            # One timeout re-armed around each write (asyncio.wait_for would start a task per
            # write, one per token); disarmed while waiting for the next token.
            async with asyncio.timeout(None) as write_deadline:
                async for chunk in self.body_iterator:
                    body = chunk.encode(self.charset) if isinstance(chunk, str) else chunk
                    write_deadline.reschedule(loop.time() + self._write_timeout_s)
                    await send({"type": "http.response.body", "body": body, "more_body": True})
                    write_deadline.reschedule(None)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except TimeoutError:
            log.info("client read nothing for %.0f s: cancelling its request", self._write_timeout_s)
            self._event("client_timeout")
        except OSError:
            log.info("client went away mid-stream")
            self._event("client_disconnected")
        except asyncio.CancelledError:
            if not _read_cancelled_by_us():
                raise
            log.info("client disconnected: request cancelled")
            self._event("client_disconnected")
        finally:
            listener.cancel()
            self._call.cancel()  # no-op when the call already ended
            await self.body_iterator.aclose()
            if self._span is not None:
                self._span.end()

    def _event(self, name: str) -> None:
        if self._span is not None:
            self._span.add_event(name)


class ResponseCounter:
    """ASGI middleware: counts each response by route and status code (`BridgeMetrics.responses`;
    route "other" where routing was not reached, e.g. a body BodyGuard refused).

    Plain ASGI, not Starlette's BaseHTTPMiddleware (`@app.middleware("http")`), which relays
    every chunk of a streaming response through a memory stream and another task: with one SSE
    event per token that hop was ≈ 15 % of the bridge's CPU under 32 streams.
    """

    def __init__(self, app: ASGIApp, metrics: BridgeMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                route = scope.get("route")
                self.metrics.responses.labels(getattr(route, "path", "other"),
                                              str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)


class BodyGuard:
    """ASGI middleware: a POST/PUT/PATCH body must fit `max_body_bytes` (413), be JSON by its
    content type when it has one (415; none counts as JSON), and be UTF-8 (400); checked before
    anything parses it.

    The body is read here (never more than the limit) and handed on unchanged; later `receive`
    calls go to the client's connection, so disconnects are still seen.
    """

    def __init__(self, app: ASGIApp, max_body_bytes: int = MAX_BODY_BYTES) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            await self._too_large(scope, receive, send)
            return
        content_type = headers.get("content-type")
        if not content_type:        # no content type: take the body as JSON
            scope = {**scope, "headers": [*scope["headers"], (b"content-type", b"application/json")]}
        elif not _is_json_type(content_type):
            await ApiError(415, f"content type {content_type.split(';')[0].strip()!r} is not supported; "
                                "send the body as application/json", code="unsupported_media_type"
                           ).response()(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return                                        # the client left before sending it all
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await self._too_large(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as exc:
            await ApiError(400, f"request body is not valid UTF-8 (byte {exc.start})",
                           code="invalid_argument").response()(scope, receive, send)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        await ApiError(413, f"request body is larger than {self.max_body_bytes} bytes",
                       code="payload_too_large").response()(scope, receive, send)


def _is_json_type(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


@dataclass(slots=True)
class BridgeState:
    """What the endpoints share, one per app: `create_app` stores it on `app.state.bridge` and the
    `bridge_state` dependency hands it to each endpoint.

    Attributes:
        grpc_target: the GenerateService's address, "host:port".
        model_name: the one model served (every completion names it, whatever the body asked).
        created_at: Unix time (s) the app was built: the model's `created` in `GET /v1/models`.
        slow_client_timeout_s: a stream whose client reads nothing this long is cancelled (s).
        keepalive_s: while a stream waits for its first token (queued behind other requests), an
            SSE comment (`SSE_KEEPALIVE`) is sent every this many seconds, so that proxies with
            an idle timeout (Envoy's stream_idle_timeout, 300 s in the chart) do not cut it.
        tracer: OpenTelemetry tracer of the request spans.
        metrics: the bridge's Prometheus metrics (and the engine's, appended to `GET /metrics`).
        backend: the gRPC channel and stubs: opened by the lifespan at startup (closed at
            shutdown), or by `connect` on first use when the app runs without its lifespan
            (bare ASGI use); None before either.
    """

    grpc_target: str
    model_name: str
    created_at: int
    slow_client_timeout_s: float
    tracer: trace.Tracer
    metrics: BridgeMetrics
    keepalive_s: float = SSE_KEEPALIVE_S
    backend: _Backend | None = None

    def connect(self) -> _Backend:
        """The gRPC backend, opened here when the lifespan has not opened one."""
        if self.backend is None:
            self.backend = _Backend(self.grpc_target)
        return self.backend


async def bridge_state(request: Request) -> BridgeState:
    """FastAPI dependency: the app's `BridgeState`. A coroutine so that FastAPI calls it on the
    event loop (a plain function would be run in its thread pool)."""
    return request.app.state.bridge


def create_app(
    grpc_target: str,
    model_name: str = DEFAULT_MODEL_NAME,
    *,
    slow_client_timeout_s: float = SLOW_CLIENT_TIMEOUT_S,
    engine_metrics_url: str | Sequence[str] | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    tracer: trace.Tracer | None = None,
    keepalive_s: float = SSE_KEEPALIVE_S,
) -> FastAPI:
    """Build the bridge app for the GenerateService at `grpc_target` ("host:port").

    `engine_metrics_url`, when given, is scraped and appended to `GET /metrics`; with several
    URLs (one per engine replica) each engine's series get a `replica` label (`BridgeMetrics`).
    `max_body_bytes` bounds request bodies (413 above). `tracer`: OpenTelemetry tracer for
    request spans (default: the global provider's, a no-op unless tracing was set up).
    `keepalive_s`: see `BridgeState.keepalive_s`.
    """
    metrics = BridgeMetrics(engine_metrics_url)
    app = FastAPI(title="genserve bridge", lifespan=_lifespan)
    app.state.bridge = BridgeState(
        grpc_target=grpc_target,
        model_name=model_name,
        created_at=int(time.time()),
        slow_client_timeout_s=slow_client_timeout_s,
        tracer=tracer or trace.get_tracer("genserve.bridge"),
        metrics=metrics,
        keepalive_s=keepalive_s,
    )
    app.add_middleware(BodyGuard, max_body_bytes=max_body_bytes)
    app.add_middleware(ResponseCounter, metrics=metrics)
    # Errors always answer {"error": {...}}.
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)
    _add_routes(app.router)
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Open the gRPC backend at startup and close it at shutdown."""
    state: BridgeState = app.state.bridge
    state.backend = _Backend(state.grpc_target)
    try:
        yield
    finally:
        await state.backend.close()


def _add_routes(router: APIRouter) -> None:
    """Register the bridge's endpoints (the module docstring lists them) on `router`, the app's
    own, so that each path is one route of the app (`include_router` would add a nested router
    the request is matched through)."""
    # FastAPI publishes an endpoint's docstring as its OpenAPI description unless given one; it
    # cuts a description at the first form feed, so "\f" publishes none: the docstrings are
    # written for readers of this module.
    no_description = "\f"
    router.add_api_route("/v1/completions", completions, methods=["POST"], description=no_description)
    router.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"],
                         description=no_description)
    router.add_api_route("/v1/requests/{request_id}", cancel, methods=["DELETE"],
                         description=no_description)
    router.add_api_route("/health", health, methods=["GET"], description=no_description)
    router.add_api_route("/metrics", prometheus_metrics, methods=["GET"], description=no_description)
    router.add_api_route("/v1/models", models, methods=["GET"], description=no_description)
    router.add_api_route("/v1/console/events", console_events, methods=["GET"], description=no_description)
    router.add_api_route("/", console_page, methods=["GET"], description=no_description,
                         include_in_schema=False)


# ---- errors: always {"error": {...}} ----------------------------------------------------------

async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
    return exc.response()


async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    return validation_error(exc.errors()).response()


async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    err = ApiError(exc.status_code, str(exc.detail), code=code, headers=dict(exc.headers or {}))
    return err.response()


async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error in the bridge")
    return ApiError(500, f"internal error: {type(exc).__name__}", code="internal").response()


# ---- endpoints -------------------------------------------------------------------------------

async def completions(body: CompletionRequest, request: Request,
                      state: Annotated[BridgeState, Depends(bridge_state)]) -> Response:
    """POST /v1/completions: one Generate call, answered as JSON or (`stream`) as SSE.

    Raises ApiError: the Generate call failed before it started (its status mapped by
    `from_grpc`), or, without `stream`, while it ran.
    """
    builder = CompletionBuilder(
        model=state.model_name,      # the model that answers, whatever `model` the body named
        created=int(time.time()),
        num_samples=body.num_samples,
        logprobs=body.logprobs is not None,
    )
    proto = body.to_proto(request_id=request.headers.get("x-request-id", ""))
    return await _generate(request, state, "/v1/completions", proto, builder, bool(body.stream))


async def chat_completions(body: ChatCompletionRequest, request: Request,
                           state: Annotated[BridgeState, Depends(bridge_state)]) -> Response:
    """POST /v1/chat/completions: one Generate call with the messages, answered as a
    `chat.completion` or (`stream`) as `chat.completion.chunk` SSE events (bridge/chat.py).

    Raises ApiError: 400 naming the message field at fault (`messages[1].role`), or as
    `completions` does.
    """
    try:
        proto = body.to_proto(request_id=request.headers.get("x-request-id", ""))
    except ChatError as e:
        raise ApiError(400, str(e), code="invalid_argument", param=e.field) from None
    builder = ChatCompletionBuilder(model=state.model_name, created=int(time.time()),
                                    num_samples=body.num_samples, logprobs=bool(body.logprobs),
                                    include_usage=body.include_usage)
    return await _generate(request, state, "/v1/chat/completions", proto, builder, bool(body.stream))


async def _generate(request: Request, state: BridgeState, route: str, proto: pb.GenerateRequest,
                    builder: Builder, stream: bool) -> Response:
    """Run one Generate call for `route` and answer with `builder`'s JSON or SSE events.

    Raises ApiError: the call failed before it started (its status mapped by `from_grpc`), or,
    without `stream`, while it ran.
    """
    span = state.tracer.start_span(f"POST {route}", kind=SpanKind.SERVER, attributes={
        "http.request.method": "POST", "http.route": route, "genserve.stream": stream})
    call = state.connect().generate.Generate(proto, metadata=inject_metadata(_auth_metadata(request), span))
    streaming = False
    try:
        # Read up to Started before answering, so that errors the service finds
        # before it starts (validation, auth, 429) are plain HTTP errors.
        first_events = builder.events_for(await _read_first(request, call))
        REQUEST_ID.set(builder.request_id)
        span.set_attribute("genserve.request_id", builder.request_id)
        span.add_event("started")
        headers = {"X-Request-Id": builder.request_id}
        if stream:
            response = SSEResponse(
                _sse_events(call, builder, _SpanNotes(span), first_events, state.keepalive_s),
                call=call,
                write_timeout_s=state.slow_client_timeout_s,
                headers={**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                span=span,
            )
            streaming = True          # the response ends the span when the stream ends
            return response
        async with _cancel_on_disconnect(request, call):
            try:
                await _drain(call, builder, _SpanNotes(span))
            except grpc.aio.AioRpcError as err:
                raise from_grpc(err) from None
            except asyncio.CancelledError:
                if not _read_cancelled_by_us():
                    raise
                span.add_event("client_disconnected")
                return Response(status_code=499)  # the client is gone; nobody reads this
        return JSONResponse(builder.completion(), headers=headers)
    except BaseException as exc:
        call.cancel()  # never leave a request generating for nobody
        if isinstance(exc, ApiError):
            _span_error(span, exc.status_code, exc.message)
        raise
    finally:
        if not streaming:
            span.end()


async def cancel(request_id: str, request: Request,
                 state: Annotated[BridgeState, Depends(bridge_state)]) -> JSONResponse:
    """DELETE /v1/requests/{request_id}: the Cancel call. Raises ApiError when it fails."""
    try:
        await state.connect().generate.Cancel(
            pb.CancelRequest(request_id=request_id),
            metadata=_auth_metadata(request),
            timeout=CANCEL_TIMEOUT_S,
        )
    except grpc.aio.AioRpcError as err:
        raise from_grpc(err) from None
    return JSONResponse({"request_id": request_id, "cancelled": True})


async def health(request: Request, state: Annotated[BridgeState, Depends(bridge_state)]) -> JSONResponse:
    """GET /health: 200 while the service is serving, else 503 with Retry-After."""
    if await _healthy(state.connect(), _auth_metadata(request)):
        return JSONResponse({"status": "ok"})
    return ApiError(503, "the generation service is not serving", code="unavailable",
                    headers={"Retry-After": str(DEFAULT_RETRY_AFTER_S)}).response()


async def prometheus_metrics(state: Annotated[BridgeState, Depends(bridge_state)]) -> Response:
    """GET /metrics: the Prometheus text exposition (version 0.0.4)."""
    return Response(await state.metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")


async def models(state: Annotated[BridgeState, Depends(bridge_state)]) -> JSONResponse:
    """GET /v1/models: the one served model, OpenAI's list shape."""
    model = {"id": state.model_name, "object": "model", "created": state.created_at, "owned_by": "genserve"}
    return JSONResponse({"object": "list", "data": [model]})


async def console_page() -> FileResponse:
    """GET /: the web console's page (its script and style under /static/)."""
    return FileResponse(INDEX_HTML, media_type="text/html; charset=utf-8",
                        headers={"Cache-Control": "no-cache"})


async def console_events(request: Request, state: Annotated[BridgeState, Depends(bridge_state)],
                         interval_ms: Annotated[int, Query(ge=0, le=UINT32_MAX)] = 0) -> Response:
    """GET /v1/console/events?interval_ms=250: the engine's scheduler snapshots as SSE, one
    `data:` event each (`bridge.console.snapshot_event`), until the client leaves. Behind Envoy
    the stream reaches one engine replica (each event's `engine` names it).

    Raises ApiError: the WatchScheduler call failed before its first snapshot (401 without a
    valid key when keys are configured; 400 for an interval outside 100-10,000 ms; 503 while
    the engine is down or loading).
    """
    call = state.connect().generate.WatchScheduler(pb.WatchSchedulerRequest(interval_ms=interval_ms),
                                                   metadata=_auth_metadata(request))
    try:
        first = await _read_first(request, call)
    except BaseException:
        call.cancel()
        raise
    return SSEResponse(_snapshot_events(call, first), call=call, write_timeout_s=state.slow_client_timeout_s,
                       headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _snapshot_events(call: grpc.aio.UnaryStreamCall,
                           first: pb.WatchSchedulerResponse) -> AsyncIterator[str]:
    """One SSE event per snapshot; a failure of the stream ends it with `event: error`."""
    yield sse_data(snapshot_event(first.snapshot))
    try:
        while (msg := await call.read()) is not grpc.aio.EOF:
            yield sse_data(snapshot_event(msg.snapshot))
    except grpc.aio.AioRpcError as err:
        api_error = from_grpc(err)
        log.info("scheduler stream ended with %s: %s", api_error.code, api_error.message)
        yield sse_error(api_error.body())


def validation_error(errors: list[dict]) -> ApiError:
    """A 400 naming the offending field(s), from pydantic/FastAPI validation errors."""
    messages: list[str] = []
    params: list[str] = []
    for err in errors:
        loc = [str(part) for part in err.get("loc", ())]
        if loc and loc[0] in ("body", "query"):
            loc = loc[1:]
        path = ".".join(loc)
        kind = err.get("type", "")
        if kind == "json_invalid":
            messages.append(f"request body is not valid JSON: {err.get('msg', '')}")
            continue
        if kind == "extra_forbidden":
            messages.append(f"unknown field '{path}'")
        elif kind == "missing" and not path:
            messages.append("a JSON request body is required")
        elif path:
            messages.append(f"invalid value for '{path}': {err.get('msg', 'invalid')}")
        else:
            messages.append(f"invalid request body: {err.get('msg', 'invalid')}")
        if loc:
            params.append(loc[0])
    message = "; ".join(dict.fromkeys(messages)) or "invalid request"
    return ApiError(400, message, code="invalid_argument", param=params[0] if params else None)


async def _read_first(request: Request, call: grpc.aio.UnaryStreamCall):
    """The stream's first message (Generate's Started, WatchScheduler's first snapshot), or the
    ApiError the call failed with."""
    async with _cancel_on_disconnect(request, call):
        try:
            first = await call.read()
        except grpc.aio.AioRpcError as err:
            raise from_grpc(err) from None
        except asyncio.CancelledError:
            if not _read_cancelled_by_us():
                raise
            raise ApiError(499, "client disconnected", code="cancelled") from None
    if first is grpc.aio.EOF:
        raise ApiError(500, "the engine's stream ended before it started", code="internal")
    return first


class _SpanNotes:
    """Span events for the messages of one stream: first_token once, finished per sample."""

    def __init__(self, span: trace.Span) -> None:
        self.span = span
        self.first_token = True

    def on_message(self, msg: pb.GenerateResponse) -> None:
        if msg.HasField("token") and self.first_token:
            self.first_token = False
            self.span.add_event("first_token")
        elif msg.HasField("finished"):
            reason = pb.FinishReason.Name(msg.finished.reason).removeprefix("FINISH_REASON_").lower()
            self.span.add_event("finished", {"genserve.index": msg.finished.index,
                                             "genserve.finish_reason": reason,
                                             "genserve.completion_tokens": msg.finished.usage.completion_tokens})


def _span_error(span: trace.Span, status_code: int, message: str) -> None:
    span.set_attribute("http.response.status_code", status_code)
    span.set_status(Status(StatusCode.ERROR, message))
    span.add_event("error", {"http.response.status_code": status_code, "message": message})


async def _drain(call: grpc.aio.UnaryStreamCall, builder: Builder, notes: _SpanNotes) -> None:
    """Feed every remaining message of `call` to `builder`."""
    while (msg := await call.read()) is not grpc.aio.EOF:
        notes.on_message(msg)
        builder.events_for(msg)


async def _first_message(call: grpc.aio.UnaryStreamCall,
                         keepalive_s: float) -> AsyncIterator[pb.GenerateResponse | None]:
    """The call's next message (or EOF), after a None every `keepalive_s` seconds that it waits.
    Raises what `call.read()` raises."""
    read = asyncio.ensure_future(call.read())
    try:
        while not (await asyncio.wait({read}, timeout=keepalive_s))[0]:
            yield None
        yield read.result()
    finally:
        read.cancel()                     # the client left while it waited (no-op when done)


async def _sse_events(call: grpc.aio.UnaryStreamCall, builder: Builder, notes: _SpanNotes,
                      first_events: Sequence[dict] = (),
                      keepalive_s: float = SSE_KEEPALIVE_S) -> AsyncIterator[str]:
    """`first_events`, then the builder's events for each message (one per token and per
    finished sample), then [DONE]; errors as `event: error`. Until the first message after
    Started arrives (a queued request's wait), an SSE comment every `keepalive_s` seconds; then
    messages are read one by one, as fast as they come."""
    for event in first_events:
        yield sse_data(event)
    try:
        msg = grpc.aio.EOF
        async for msg in _first_message(call, keepalive_s):
            if msg is None:
                yield SSE_KEEPALIVE
        while msg is not grpc.aio.EOF:
            notes.on_message(msg)
            for event in builder.events_for(msg):
                yield sse_data(event)
            msg = await call.read()
    except grpc.aio.AioRpcError as err:
        api_error = from_grpc(err)
        log.warning("stream ended with %s: %s", api_error.code, api_error.message,
                    extra={"request_id": builder.request_id})
        _span_error(notes.span, api_error.status_code, api_error.message)
        yield sse_error(api_error.body())
        return
    if builder.all_finished:
        yield SSE_DONE
    else:
        err = ApiError(500, "the generation stream ended before every sample finished", code="internal")
        _span_error(notes.span, err.status_code, err.message)
        yield sse_error(err.body())


async def _healthy(backend: _Backend, metadata: tuple[tuple[str, str], ...]) -> bool:
    """SERVING per grpc.health.v1; without a health service, whether Info answers."""
    try:
        reply = await backend.health.Check(
            health_pb2.HealthCheckRequest(service=HEALTH_SERVICE_NAME), timeout=HEALTH_TIMEOUT_S
        )
        return reply.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.aio.AioRpcError as err:
        if err.code() not in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.NOT_FOUND):
            return False
    try:
        await backend.generate.Info(pb.InfoRequest(), metadata=metadata, timeout=HEALTH_TIMEOUT_S)
    except grpc.aio.AioRpcError:
        return False
    return True
