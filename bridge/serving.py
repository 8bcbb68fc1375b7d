"""The path both completion endpoints share: one Generate call, traced as one span, answered
as JSON or as SSE (`generate`).

/v1/completions and /v1/chat/completions differ only in their request body and their response
builder (bridge/completions.py, bridge/chat.py); `generate` runs the call for either. It reads
the stream up to Started before answering, so that errors the service finds before it starts
(validation, auth, 429) are plain HTTP errors; then it streams the builder's events
(`bridge.sse.SSEResponse`) or collects the whole completion as one JSON object.
"""

from __future__ import annotations

import asyncio

import grpc
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from opentelemetry.trace import SpanKind

from bridge.errors import ApiError, from_grpc
from bridge.spans import SpanNotes, span_error
from bridge.sse import (Builder, SSEResponse, cancel_on_disconnect, drain, read_cancelled_by_us, read_first,
                        sse_events)
from bridge.state import BridgeState, auth_metadata
from genserve.common.telemetry import REQUEST_ID, inject_metadata
from genserve.v1 import generate_pb2 as pb


async def generate(request: Request, state: BridgeState, route: str, proto: pb.GenerateRequest,
                   builder: Builder, stream: bool) -> Response:
    """Run one Generate call for `route` and answer with `builder`'s JSON or SSE events.

    Raises ApiError: the call failed before it started (its status mapped by `from_grpc`), or,
    without `stream`, while it ran.
    """
    span = state.tracer.start_span(f"POST {route}", kind=SpanKind.SERVER, attributes={
        "http.request.method": "POST", "http.route": route, "genserve.stream": stream})
    call = state.connect().generate.Generate(proto, metadata=inject_metadata(auth_metadata(request), span))
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
