"""The bridge's ASGI middleware: the request body checks (`BodyGuard`) and the response count
by route and status (`ResponseCounter`).

Both are plain ASGI classes, not Starlette's BaseHTTPMiddleware, so a streamed response's chunks
pass straight through. `create_app` adds BodyGuard first, so ResponseCounter, outermost, counts
BodyGuard's refusals too.
"""

from __future__ import annotations

import asyncio

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from bridge.errors import ApiError
from bridge.metrics import BridgeMetrics

# Largest request body accepted (413 above). A full 8,192-token prompt is well under 100 KB.
MAX_BODY_BYTES = 1024 * 1024

DRAIN_TIME_S = 30.0
"""How long the bridge reads (and drops) the rest of a body over the limit before it answers 413,
seconds (nginx's `lingering_time` default). A server that answers and closes while the client
still sends resets the connection, and a client that writes its whole body before it reads
(httpx, most SDKs, Envoy in front) then sees the reset, not the 413. Past this time the 413 is
sent anyway."""


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
            await self._too_large(scope, receive, send, more_body=True)
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
                await self._too_large(scope, receive, send, more_body=message.get("more_body", False))
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

    async def _too_large(self, scope: Scope, receive: Receive, send: Send, *, more_body: bool) -> None:
        """Answer 413, after reading the rest of the body (`more_body`: some is unread) for up to
        `DRAIN_TIME_S` seconds, so the answer is read rather than lost in a reset. Nothing is kept."""
        if more_body:
            try:
                async with asyncio.timeout(DRAIN_TIME_S):
                    while True:
                        message = await receive()
                        if message["type"] == "http.disconnect":
                            return                            # the client left: nobody to answer
                        if not message.get("more_body", False):
                            break
            except TimeoutError:
                pass
        await ApiError(413, f"request body is larger than {self.max_body_bytes} bytes",
                       code="payload_too_large").response()(scope, receive, send)


def _is_json_type(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))
