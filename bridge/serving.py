"""The path both completion endpoints share: one Generate call (or one per prompt, read as one
by `bridge.fanout.CallGroup`), traced as one span, answered as JSON or as SSE (`generate`).

/v1/completions and /v1/chat/completions differ only in their request body and their response
builder (bridge/completions.py, bridge/chat.py); `generate` runs the call for either. It reads
the stream up to Started before answering, so that errors the service finds before it starts
(validation, auth, 429) are plain HTTP errors; then it streams the builder's events
(`bridge.sse.SSEResponse`) or collects the whole completion as one JSON object. Each call carries
the prefix routing key (`genserve.common.prefix_route`) that Envoy hashes to pick the replica.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import grpc
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from opentelemetry.trace import SpanKind

from bridge.errors import ApiError, from_grpc, rename_param
from bridge.fanout import CallGroup
from bridge.spans import SpanNotes, span_error
from bridge.sse import (Builder, SSEResponse, cancel_on_disconnect, drain, read_cancelled_by_us, read_first,
                        sse_events)
from bridge.state import BridgeState, auth_metadata
from genserve.common.prefix_route import ROUTE_KEY_HEADER, request_route_key
from genserve.common.telemetry import REQUEST_ID, inject_metadata
from genserve.v1 import generate_pb2 as pb

log = logging.getLogger(__name__)


def record_fields(span, fields: Mapping[str, Any], route: str) -> None:
    """Put the request fields the policy records (`user`, `metadata`, `store`, `service_tier`,
    `safety_identifier`: accepted with no effect) on the span and in one log line."""
    if not fields:
        return
    as_text = {name: v if isinstance(v, str) else json.dumps(v, sort_keys=True) for name, v in fields.items()}
    span.set_attributes({f"genserve.openai.{name}": v for name, v in as_text.items()})
    log.info("request fields recorded", extra={"route": route, "openai_fields": as_text})


async def generate(request: Request, state: BridgeState, route: str,
                   protos: pb.GenerateRequest | Sequence[pb.GenerateRequest], builder: Builder, stream: bool,
                   recorded: Mapping[str, Any] | None = None,
                   fields: Mapping[str, str] | None = None) -> Response:
    """Run the Generate call (one per GenerateRequest in `protos`, read as one `CallGroup`) for
    `route` and answer with `builder`'s JSON or SSE events. `recorded`: fields to put on the span
    and in the log (`record_fields`). `fields`: gRPC request field -> the REST field the client
    sent for it, so that an engine error names the client's field (`bridge.errors.rename_param`:
    ``response_format.json_schema.schema``, not ``json_schema``; ``guided_choice[0]``, not
    ``choice[0]``; ``max_completion_tokens``, not ``max_tokens``).

    Raises ApiError: the call failed before it started (its status mapped by `from_grpc`), or,
    without `stream`, while it ran.
    """
    span = state.tracer.start_span(f"POST {route}", kind=SpanKind.SERVER, attributes={
        "http.request.method": "POST", "http.route": route, "genserve.stream": stream})
    record_fields(span, recorded or {}, route)
    if isinstance(protos, pb.GenerateRequest):
        protos = [protos]
    metadata = inject_metadata(auth_metadata(request), span)
    # Each call carries its prefix routing key: Envoy sends the turns of one conversation (of one
    # tenant) to the replica that holds their cached prefix (genserve/common/prefix_route.py).
    authorization = request.headers.get("authorization", "")
    calls = [state.connect().generate.Generate(
        p, metadata=(*metadata, (ROUTE_KEY_HEADER, request_route_key(p, authorization))))
        for p in protos]
    if len(calls) == 1:
        call = calls[0]
    else:
        # A client that named the request (X-Request-Id) may cancel it as soon as its calls are
        # sent, before every Started has been read: register the ids it will cancel now.
        group_id: list[str] = []
        named = [p.request_id for p in protos]
        if all(named):
            group_id.append(named[0])
            state.groups[named[0]] = named

        def on_ids(request_id: str, ids: list[str]) -> None:
            if group_id and group_id[0] != request_id:
                state.groups.pop(group_id.pop(), None)
            if not group_id:
                group_id.append(request_id)
            state.groups[request_id] = ids

        call = CallGroup(calls, protos[0].n if protos[0].HasField("n") else 1, on_ids=on_ids,
                         on_close=lambda: group_id and state.groups.pop(group_id[0], None))
        builder.prompt_tokens_each = call.prompt_tokens
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
            rename_param(exc, fields or {})
            span_error(span, exc.status_code, exc.message)
        raise
    finally:
        if not streaming:
            span.end()
