"""Server-sent events from a gRPC server stream: the framing, the streaming response, and the
reads that feed it.

The bridge answers a Generate (or WatchScheduler) stream over HTTP with these: `read_first` reads
the stream's first message before any response starts (so that errors the service finds first
are plain HTTP errors); after it, either `sse_events` turns the remaining messages into SSE events
(`sse_data`, `sse_error`, keep-alive comments while a queued request waits, then `SSE_DONE`),
streamed by `SSEResponse`, which cancels the gRPC call when the client leaves or stops reading;
or, for a JSON answer, `drain` feeds them all to the builder. `Builder` is what `sse_events` and
`drain` need of a response builder.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Protocol

import grpc
from fastapi import Request
from fastapi.responses import StreamingResponse
from opentelemetry import trace
from starlette.types import Receive, Scope, Send

from bridge.errors import ApiError, from_grpc
from bridge.spans import SpanNotes, span_error
from genserve.v1 import generate_pb2 as pb

log = logging.getLogger(__name__)

SSE_DONE = "data: [DONE]\n\n"
# An SSE comment line: clients skip it (the SSE specification's "lines starting with a colon"),
# while its bytes keep proxies from closing a stream that waits (Envoy's stream_idle_timeout).
SSE_KEEPALIVE = ": keep-alive\n\n"
# A queued stream's keep-alive comment interval, seconds (sse-starlette's default ping interval):
# far below Envoy's 300 s stream_idle_timeout (charts/genserve/values.yaml).
SSE_KEEPALIVE_S = 15.0


def sse_data(event: dict) -> str:
    """One SSE `data:` event."""
    return f"data: {_dumps(event)}\n\n"


def sse_error(body: dict) -> str:
    """One SSE `event: error` carrying the JSON error body."""
    return f"event: error\ndata: {_dumps(body)}\n\n"


# Characters Python's str.splitlines() (and so httpx's `aiter_lines`) treats as line breaks that
# JSON leaves unescaped (control characters below U+0020 are always escaped): a client splitting
# an SSE stream with them would cut an event in two. The SSE spec breaks lines on CR and LF only;
# escaping these three keeps the JSON equal and every client whole.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def _dumps(obj: dict) -> str:
    """Compact UTF-8 JSON for one SSE data line, with no character any client reads as a newline."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).translate(_LINE_BREAKS)


class Builder(Protocol):
    """What the bridge's generate path needs of a response builder
    (`bridge.completions.CompletionBuilder` for /v1/completions, `bridge.chat.ChatCompletionBuilder`
    for /v1/chat/completions)."""

    request_id: str

    @property
    def all_finished(self) -> bool:
        """Whether every sample has sent its Finished message."""

    def events_for(self, msg: pb.GenerateResponse) -> list[dict]:
        """Record one message; return the SSE events it makes, in order (possibly none)."""

    def completion(self) -> dict:
        """The whole answer as one JSON object (for stream=false)."""


async def _wait_for_disconnect(receive: Receive) -> None:
    """Return once the client has gone (the ASGI server says http.disconnect)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


@contextlib.asynccontextmanager
async def cancel_on_disconnect(request: Request, call: grpc.aio.Call) -> AsyncIterator[None]:
    """While inside, a client disconnect cancels `call` (for work done before the response starts)."""
    watcher = asyncio.create_task(_wait_for_disconnect(request.receive))
    watcher.add_done_callback(lambda t: t.cancelled() or call.cancel())
    try:
        yield
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher


def read_cancelled_by_us() -> bool:
    """Whether a CancelledError came from a cancelled gRPC call, not from our task being cancelled."""
    task = asyncio.current_task()
    return task is None or task.cancelling() == 0


async def read_first(request: Request, call: grpc.aio.UnaryStreamCall):
    """The stream's first message (Generate's Started, WatchScheduler's first snapshot), or the
    ApiError the call failed with."""
    async with cancel_on_disconnect(request, call):
        try:
            first = await call.read()
        except grpc.aio.AioRpcError as err:
            raise from_grpc(err) from None
        except asyncio.CancelledError:
            if not read_cancelled_by_us():
                raise
            raise ApiError(499, "client disconnected", code="cancelled") from None
    if first is grpc.aio.EOF:
        raise ApiError(500, "the engine's stream ended before it started", code="internal")
    return first


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
            if not read_cancelled_by_us():
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


async def sse_events(call: grpc.aio.UnaryStreamCall, builder: Builder, notes: SpanNotes,
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
        span_error(notes.span, api_error.status_code, api_error.message)
        yield sse_error(api_error.body())
        return
    if builder.all_finished:
        yield SSE_DONE
    else:
        err = ApiError(500, "the generation stream ended before every sample finished", code="internal")
        span_error(notes.span, err.status_code, err.message)
        yield sse_error(err.body())


async def drain(call: grpc.aio.UnaryStreamCall, builder: Builder, notes: SpanNotes) -> None:
    """Feed every remaining message of `call` to `builder`."""
    while (msg := await call.read()) is not grpc.aio.EOF:
        notes.on_message(msg)
        builder.events_for(msg)
