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
`genserve.telemetry`); events: started, first_token, finished (per sample), error.

The bridge only translates. It forwards `Authorization: Bearer <key>` as gRPC
metadata `authorization`, maps gRPC status codes to HTTP (errors.py), and turns
each GenerateResponse into one SSE event (events.py). A client that disconnects,
or reads nothing for `slow_client_timeout_s`, has its gRPC call cancelled, which
cancels the request in the engine.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Annotated

import grpc
from fastapi import APIRouter, Depends, FastAPI, Query, Request
from opentelemetry import trace
from opentelemetry.trace import SpanKind
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bridge.chat import ChatCompletionBuilder
from bridge.console import INDEX_HTML, STATIC_DIR, snapshot_event
from bridge.errors import DEFAULT_RETRY_AFTER_S, ApiError, add_exception_handlers, from_grpc
from bridge.completions import CompletionBuilder
from bridge.metrics import BridgeMetrics
from bridge.middleware import MAX_BODY_BYTES, BodyGuard, ResponseCounter
from bridge.protocol import UINT32_MAX, ChatCompletionRequest, CompletionRequest
from bridge.spans import SpanNotes, span_error
from bridge.sse import (SSE_KEEPALIVE_S, Builder, SSEResponse, cancel_on_disconnect, drain, read_cancelled_by_us,
                        read_first, sse_data, sse_error, sse_events)
from genserve.chat_messages import ChatError
from genserve.model_name import DEFAULT_MODEL_NAME
from genserve.telemetry import REQUEST_ID, inject_metadata
from genserve.v1 import generate_pb2 as pb
from genserve.v1 import generate_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

# The name the service registers with grpc.health.v1 (falls back to Info if absent).
HEALTH_SERVICE_NAME = "genserve.v1.GenerateService"
HEALTH_TIMEOUT_S = 2.0
CANCEL_TIMEOUT_S = 5.0
# Cancel a client that reads nothing for 30 s (docs/design.md, "Fairness, cancellation and streaming").
SLOW_CLIENT_TIMEOUT_S = 30.0
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
    add_exception_handlers(app)
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
        first_events = builder.events_for(await read_first(request, call))
        REQUEST_ID.set(builder.request_id)
        span.set_attribute("genserve.request_id", builder.request_id)
        span.add_event("started")
        headers = {"X-Request-Id": builder.request_id}
        if stream:
            response = SSEResponse(
                sse_events(call, builder, SpanNotes(span), first_events, state.keepalive_s),
                call=call,
                write_timeout_s=state.slow_client_timeout_s,
                headers={**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                span=span,
            )
            streaming = True          # the response ends the span when the stream ends
            return response
        async with cancel_on_disconnect(request, call):
            try:
                await drain(call, builder, SpanNotes(span))
            except grpc.aio.AioRpcError as err:
                raise from_grpc(err) from None
            except asyncio.CancelledError:
                if not read_cancelled_by_us():
                    raise
                span.add_event("client_disconnected")
                return Response(status_code=499)  # the client is gone; nobody reads this
        return JSONResponse(builder.completion(), headers=headers)
    except BaseException as exc:
        call.cancel()  # never leave a request generating for nobody
        if isinstance(exc, ApiError):
            span_error(span, exc.status_code, exc.message)
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
        first = await read_first(request, call)
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
