"""The bridge's FastAPI app: OpenAI-style REST + SSE in front of gRPC GenerateService.

    POST   /v1/completions              -> Generate (server stream)
    POST   /v1/chat/completions         -> Generate with chat messages (server stream)
    POST   /v1/responses                -> the same, in OpenAI's Responses shape (stateless)
    DELETE /v1/requests/{request_id}    -> Cancel
    GET    /health                      -> grpc.health.v1 Check (or Info)
    GET    /v1/models                   -> ListModels: the served model and the key's LoRA adapters
    GET    /v1/models/{model}           -> that model (404 for any other name)
    POST   /v1/load_lora_adapter        -> LoadLoraAdapter (admin keys)
    POST   /v1/unload_lora_adapter      -> UnloadLoraAdapter (admin keys)
    POST   /tokenize                    -> Tokenize (vLLM's endpoint)
    POST   /detokenize                  -> Detokenize (vLLM's endpoint)
    GET    /metrics                     -> the bridge's and the engine's Prometheus metrics
    GET    /                            -> the web console (playground + live scheduler view)
    GET    /static/...                  -> the console's files (bridge/static/)
    GET    /v1/console/events           -> WatchScheduler (server stream), as SSE
    GET    /v1/console/replicas         -> each engine replica's prefix-cache and request counters

A request body must be JSON (`application/json`, `+json`, or no content type: 415 otherwise),
UTF-8 (400) and at most `max_body_bytes` (1 MiB by default: 413), checked before parsing.

Each completion is one OpenTelemetry span ("POST /v1/completions") whose W3C trace context goes
to the engine in the gRPC metadata, so the engine's span joins the same trace (see
`genserve.common.telemetry`); events: started, first_token, finished (per sample), error.

The bridge only translates. It forwards `Authorization: Bearer <key>` as gRPC
metadata `authorization`, maps gRPC status codes to HTTP (errors.py), and turns
each GenerateResponse into one SSE event (completions.py, chat.py). A client that disconnects,
or reads nothing for `slow_client_timeout_s`, has its gRPC call cancelled, which
cancels the request in the engine.

This module builds the app (`create_app`: its state, middleware, error handlers and route
table) and holds the small endpoints. The rest of the bridge, each module importing only bridge
modules listed below it:

    chat.py         POST /v1/chat/completions: handler and ChatCompletionBuilder
    responses.py    POST /v1/responses: the request as a chat request, ResponseBuilder
    completions.py  POST /v1/completions: handler and CompletionBuilder
    serving.py      the Generate call both share: span, first message, JSON or SSE answer
    fanout.py       several Generate calls (one per prompt) read as one
    state.py        BridgeState, the gRPC backend, the `bridge_state` dependency
    sse.py          SSE framing, SSEResponse, reading a gRPC stream into a response
    spans.py        the request span's events
    middleware.py   BodyGuard (body size, type, UTF-8), ResponseCounter
    errors.py       the error body, gRPC -> HTTP status, validation errors, exception handlers
    protocol.py     request bodies -> GenerateRequest; response fields both endpoints share
    fields.py       the field policy: every request field honoured, accepted or not supported
    console.py      the web console's files, snapshot JSON and replicas JSON
    metrics.py      the bridge's Prometheus metrics and the engines', for GET /metrics
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Annotated

import grpc
from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from grpc_health.v1 import health_pb2
from opentelemetry import trace

from bridge.chat import chat_completions
from bridge.completions import completions
from bridge.constraints import ConstraintFieldError
from bridge.console import INDEX_HTML, STATIC_DIR, replicas_event, snapshot_event
from bridge.errors import ApiError, DEFAULT_RETRY_AFTER_S, add_exception_handlers, from_grpc
from bridge.metrics import BridgeMetrics
from bridge.middleware import BodyGuard, MAX_BODY_BYTES, ResponseCounter
from bridge.protocol import (UINT32_MAX, DetokenizeRequest, LoadLoraAdapterRequest, TokenizeRequest,
                             UnloadLoraAdapterRequest)
from bridge.responses import create_response
from bridge.sse import SSEResponse, SSE_KEEPALIVE_S, read_first, sse_data, sse_error
from bridge.state import Backend, BridgeState, auth_metadata, bridge_state
from bridge.tools import GENERIC
from genserve.common.chat_messages import ChatError
from genserve.common.keepalive import PING_INTERVAL_S
from genserve.common.model_name import DEFAULT_MODEL_NAME
from genserve.v1 import generate_pb2 as pb

log = logging.getLogger(__name__)

# The name the service registers with grpc.health.v1 (falls back to Info if absent).
HEALTH_SERVICE_NAME = "genserve.v1.GenerateService"
HEALTH_TIMEOUT_S = 2.0
CANCEL_TIMEOUT_S = 5.0
TOKENIZE_TIMEOUT_S = 30.0
# Cancel a client that reads nothing for 30 s (docs/design.md, "Fairness, cancellation and streaming").
SLOW_CLIENT_TIMEOUT_S = 30.0


def create_app(
    grpc_target: str,
    model_name: str = DEFAULT_MODEL_NAME,
    *,
    slow_client_timeout_s: float = SLOW_CLIENT_TIMEOUT_S,
    engine_metrics_url: str | Sequence[str] | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    tracer: trace.Tracer | None = None,
    keepalive_s: float = SSE_KEEPALIVE_S,
    grpc_ping_interval_s: float = PING_INTERVAL_S,
) -> FastAPI:
    """Build the bridge app for the GenerateService at `grpc_target` ("host:port").

    `engine_metrics_url`, when given, is scraped and appended to `GET /metrics`; with several
    URLs (one per engine replica) each engine's series get a `replica` label (`BridgeMetrics`).
    `max_body_bytes` bounds request bodies (413 above). `tracer`: OpenTelemetry tracer for
    request spans (default: the global provider's, a no-op unless tracing was set up).
    `keepalive_s`: see `BridgeState.keepalive_s`; `grpc_ping_interval_s`: see
    `BridgeState.grpc_ping_interval_s`.
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
        grpc_ping_interval_s=grpc_ping_interval_s,
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
    state.backend = Backend(state.grpc_target, state.grpc_ping_interval_s)
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
    router.add_api_route("/v1/responses", create_response, methods=["POST"], description=no_description)
    router.add_api_route("/v1/requests/{request_id}", cancel, methods=["DELETE"],
                         description=no_description)
    router.add_api_route("/health", health, methods=["GET"], description=no_description)
    router.add_api_route("/metrics", prometheus_metrics, methods=["GET"], description=no_description)
    router.add_api_route("/v1/models", models, methods=["GET"], description=no_description)
    router.add_api_route("/v1/models/{model:path}", model_info, methods=["GET"], description=no_description)
    router.add_api_route("/v1/load_lora_adapter", load_lora_adapter, methods=["POST"], description=no_description)
    router.add_api_route("/v1/unload_lora_adapter", unload_lora_adapter, methods=["POST"],
                         description=no_description)
    router.add_api_route("/tokenize", tokenize, methods=["POST"], description=no_description)
    router.add_api_route("/detokenize", detokenize, methods=["POST"], description=no_description)
    router.add_api_route("/v1/console/events", console_events, methods=["GET"], description=no_description)
    router.add_api_route("/v1/console/replicas", console_replicas, methods=["GET"], description=no_description)
    router.add_api_route("/", console_page, methods=["GET"], description=no_description,
                         include_in_schema=False)


# ---- endpoints (/v1/completions: bridge/completions.py; /v1/chat/completions: bridge/chat.py) ----

async def cancel(request_id: str, request: Request,
                 state: Annotated[BridgeState, Depends(bridge_state)]) -> JSONResponse:
    """DELETE /v1/requests/{request_id}: the Cancel call (one per prompt's call for a completion
    with several prompts, `BridgeState.groups`). Raises ApiError when it fails (for a group: when
    every call's Cancel failed, with the first failure)."""
    failure: ApiError | None = None
    cancelled = 0
    for call_id in state.groups.get(request_id, [request_id]):
        try:
            await state.connect().generate.Cancel(
                pb.CancelRequest(request_id=call_id),
                metadata=auth_metadata(request),
                timeout=CANCEL_TIMEOUT_S,
            )
            cancelled += 1
        except grpc.aio.AioRpcError as err:
            failure = failure or from_grpc(err)
    if not cancelled:
        raise failure
    return JSONResponse({"request_id": request_id, "cancelled": True})


async def health(request: Request, state: Annotated[BridgeState, Depends(bridge_state)]) -> JSONResponse:
    """GET /health: 200 while the service is serving, else 503 with Retry-After."""
    if await _healthy(state.connect(), auth_metadata(request)):
        return JSONResponse({"status": "ok"})
    return ApiError(503, "the generation service is not serving", code="unavailable",
                    headers={"Retry-After": str(DEFAULT_RETRY_AFTER_S)}).response()


async def prometheus_metrics(state: Annotated[BridgeState, Depends(bridge_state)]) -> Response:
    """GET /metrics: the Prometheus text exposition (version 0.0.4)."""
    return Response(await state.metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")


async def _model_cards(state: BridgeState, request: Request) -> list[dict]:
    """The served model and the LoRA adapters the caller's key may use (the ListModels call), in
    vLLM's shape: adapters carry `root` (their directory) and `parent` (the base model). Only the
    served model when the call fails (an engine without it, or a caller without a valid key)."""
    base = {"id": state.model_name, "object": "model", "created": state.created_at, "owned_by": "genserve",
            "root": state.model_name, "parent": None}
    try:
        reply = await state.connect().generate.ListModels(pb.ListModelsRequest(), metadata=auth_metadata(request),
                                                          timeout=TOKENIZE_TIMEOUT_S)
    except grpc.aio.AioRpcError:
        return [base]
    return [base] + [{"id": m.id, "object": "model", "created": m.created or state.created_at, "owned_by": "genserve",
                      "root": m.root, "parent": m.parent} for m in reply.models if m.parent]


async def models(request: Request, state: Annotated[BridgeState, Depends(bridge_state)]) -> JSONResponse:
    """GET /v1/models: the served model and the LoRA adapters the caller's key may use, each with
    its parent (OpenAI's list shape, vLLM's fields)."""
    return JSONResponse({"object": "list", "data": await _model_cards(state, request)})


async def model_info(model: str, request: Request,
                     state: Annotated[BridgeState, Depends(bridge_state)]) -> JSONResponse:
    """GET /v1/models/{model}: the served model or one of the caller's adapters (OpenAI's
    retrieve); any other name is a 404 in OpenAI's error shape."""
    card = next((c for c in await _model_cards(state, request) if c["id"] == model), None)
    if card is None:
        raise ApiError(404, f"The model '{model}' does not exist; this server serves '{state.model_name}'",
                       code="model_not_found", param="model", type="invalid_request_error")
    return JSONResponse(card)


async def load_lora_adapter(body: LoadLoraAdapterRequest, request: Request,
                            state: Annotated[BridgeState, Depends(bridge_state)]) -> Response:
    """POST /v1/load_lora_adapter (vLLM's; admin keys): load a PEFT adapter directory under
    `lora_name`. 200 with vLLM's text; 400 naming the field for a bad directory or a name in use
    (the engine keeps serving), 403 for a key that is not an admin's. Behind Envoy with several
    replicas the call reaches one of them: start them with `--lora-modules` instead."""
    try:
        await state.connect().generate.LoadLoraAdapter(body.to_proto(), metadata=auth_metadata(request),
                                                       timeout=TOKENIZE_TIMEOUT_S)
    except grpc.aio.AioRpcError as err:
        raise from_grpc(err) from None
    return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.", media_type="text/plain")


async def unload_lora_adapter(body: UnloadLoraAdapterRequest, request: Request,
                              state: Annotated[BridgeState, Depends(bridge_state)]) -> Response:
    """POST /v1/unload_lora_adapter (vLLM's; admin keys): new requests naming it get 404, those
    running on it finish on it. 404 when it is not loaded, 403 for a key that is not an admin's."""
    try:
        await state.connect().generate.UnloadLoraAdapter(body.to_proto(), metadata=auth_metadata(request),
                                                         timeout=TOKENIZE_TIMEOUT_S)
    except grpc.aio.AioRpcError as err:
        raise from_grpc(err) from None
    return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.", media_type="text/plain")


async def tokenize(body: TokenizeRequest, request: Request,
                   state: Annotated[BridgeState, Depends(bridge_state)]) -> JSONResponse:
    """POST /tokenize (vLLM's): `{"prompt": ...}` or `{"messages": [...]}` -> `{"tokens", "count",
    "max_model_len", "token_strs"}`, counted as a completion's prompt is (the engine's Tokenize).

    Raises ApiError: 400 naming the field at fault, or the Tokenize call's status mapped.
    """
    refused = body.policy_refusal()
    if refused is not None:
        raise ApiError(400, refused.message, code=refused.code, param=refused.field)
    fmt = await state.tool_format(auth_metadata(request)) if body.messages is not None and body.uses_tools() \
        else GENERIC
    try:
        proto = body.to_proto(fmt)
    except (ChatError, ConstraintFieldError) as e:
        raise ApiError(400, str(e), code="invalid_argument", param=e.field) from None
    try:
        reply = await state.connect().generate.Tokenize(proto, metadata=auth_metadata(request),
                                                        timeout=TOKENIZE_TIMEOUT_S)
    except grpc.aio.AioRpcError as err:
        raise from_grpc(err) from None
    tokens = list(reply.tokens)
    return JSONResponse({"count": len(tokens), "max_model_len": reply.max_context, "tokens": tokens,
                         "token_strs": None})


async def detokenize(body: DetokenizeRequest, request: Request,
                     state: Annotated[BridgeState, Depends(bridge_state)]) -> JSONResponse:
    """POST /detokenize (vLLM's): `{"tokens": [...]}` -> `{"prompt": text}` (the engine's
    Detokenize). Raises ApiError: the call's status mapped (400 for an id outside the vocabulary)."""
    try:
        reply = await state.connect().generate.Detokenize(pb.DetokenizeRequest(tokens=body.tokens),
                                                          metadata=auth_metadata(request),
                                                          timeout=TOKENIZE_TIMEOUT_S)
    except grpc.aio.AioRpcError as err:
        raise from_grpc(err) from None
    return JSONResponse({"prompt": reply.text})


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
                                                   metadata=auth_metadata(request))
    try:
        first = await read_first(request, call)
    except BaseException:
        call.cancel()
        raise
    return SSEResponse(_snapshot_events(call, first), call=call, write_timeout_s=state.slow_client_timeout_s,
                       headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def console_replicas(state: Annotated[BridgeState, Depends(bridge_state)]) -> JSONResponse:
    """GET /v1/console/replicas: `{"replicas": [...]}`, each engine replica's prefix-cache
    tokens (queried, hit, their ratio), finished requests and running rows, read now from its
    Prometheus endpoint (`bridge.console.replicas_event`; `[]` without engine metrics URLs).

    Like GET /metrics it takes no API key: it shows only numbers GET /metrics already exposes,
    summed over their labels. Each call reads every engine's endpoint once, concurrently (at
    most 2 s each, `bridge.metrics.ENGINE_SCRAPE_TIMEOUT_S`); an engine not reached, or whose
    answer is not the Prometheus text format, is `up: false` with null numbers (a failed read
    counts in `genserve_bridge_engine_scrape_errors_total`), never an error status.
    """
    return JSONResponse(replicas_event(await state.metrics.scrape_engines()),
                        headers={"Cache-Control": "no-cache"})


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


async def _healthy(backend: Backend, metadata: tuple[tuple[str, str], ...]) -> bool:
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
