"""What the bridge's endpoints share: `BridgeState` (one per app), the gRPC backend it opens,
the `bridge_state` FastAPI dependency that hands it to an endpoint, and the caller's credentials
as gRPC metadata (`auth_metadata`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import grpc
from fastapi import Request
from grpc_health.v1 import health_pb2_grpc
from opentelemetry import trace

from bridge.metrics import BridgeMetrics
from bridge.sse import SSE_KEEPALIVE_S
from bridge.tools import GENERIC, ToolFormat, tool_format
from genserve.common import keepalive
from genserve.v1 import generate_pb2 as pb, generate_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
INFO_TIMEOUT_S = 5.0          # the engine's Info call, asked once for its tool-call format

# While the engine is down (restarting), calls fail at once with UNAVAILABLE (503 + Retry-After);
# the channel retries the connection at most this often, so the bridge recovers on its own
# within about a second of the engine coming back (gRPC's default back-off grows to 120 s).
CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
)


class Backend:
    """The app's one gRPC channel and the stubs on it.

    Args:
        target: "host:port" of the GenerateService (Envoy's listener, or an engine).
        ping_interval_s: HTTP/2 keepalive ping interval of the channel, seconds
            (`genserve.common.keepalive.channel_options`; the engines accept pings that often).
    """

    def __init__(self, target: str, ping_interval_s: float = keepalive.PING_INTERVAL_S) -> None:
        self.channel = grpc.aio.insecure_channel(
            target, options=CHANNEL_OPTIONS + keepalive.channel_options(ping_interval_s))
        self.generate = pb_grpc.GenerateServiceStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    async def close(self) -> None:
        """Close the channel (calls still on it are cancelled)."""
        await self.channel.close()


def auth_metadata(request: Request) -> tuple[tuple[str, str], ...]:
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
            SSE comment (`bridge.sse.SSE_KEEPALIVE`) is sent every this many seconds, so that
            proxies with an idle timeout (Envoy's stream_idle_timeout, 300 s in the chart) do not
            cut it.
        grpc_ping_interval_s: the gRPC channel's HTTP/2 keepalive ping interval, seconds
            (`genserve.common.keepalive`).
        tracer: OpenTelemetry tracer of the request spans.
        metrics: the bridge's Prometheus metrics (and the engine's, appended to `GET /metrics`).
        backend: the gRPC channel and stubs: opened by the lifespan at startup (closed at
            shutdown), or by `connect` on first use when the app runs without its lifespan
            (bare ASGI use); None before either.
        groups: the completions with several prompts running now: the request id their answer
            carries -> each prompt's Generate call's id (`bridge.fanout.CallGroup`), so that a
            cancel of the one cancels them all.
        tool_call_parser: the served model's tool-call format as its engine reports it
            (``InfoResponse.tool_call_parser``, "" for the generic prompt); None until a request
            with tools first asks (`tool_format`).
    """

    grpc_target: str
    model_name: str
    created_at: int
    slow_client_timeout_s: float
    tracer: trace.Tracer
    metrics: BridgeMetrics
    keepalive_s: float = SSE_KEEPALIVE_S
    grpc_ping_interval_s: float = keepalive.PING_INTERVAL_S
    backend: Backend | None = None
    groups: dict[str, list[str]] = field(default_factory=dict)
    tool_call_parser: str | None = None

    async def tool_format(self, metadata: tuple[tuple[str, str], ...] = ()) -> ToolFormat:
        """The served model's tool-call format (bridge/tools.py): the engine's Info answer, asked
        once and kept (every replica serves the same model). An engine that does not answer (down,
        or one that predates the field) gives the generic prompt, not kept: the Generate call that
        follows reports the engine's state; a format this bridge does not know gives the generic
        prompt too (the tools are then written into the conversation, which any template takes)."""
        if self.tool_call_parser is None:
            try:
                info = await self.connect().generate.Info(pb.InfoRequest(), metadata=metadata,
                                                          timeout=INFO_TIMEOUT_S)
            except grpc.aio.AioRpcError as err:
                log.info("engine Info failed (%s): tool calls in the generic format for this request",
                         err.code())
                return GENERIC
            self.tool_call_parser = info.tool_call_parser
        try:
            return tool_format(self.tool_call_parser)
        except ValueError:
            log.warning("the engine's tool-call parser %r is unknown to this bridge: the generic "
                        "tool prompt is used", self.tool_call_parser)
            return GENERIC

    def connect(self) -> Backend:
        """The gRPC backend, opened here when the lifespan has not opened one."""
        if self.backend is None:
            self.backend = Backend(self.grpc_target, self.grpc_ping_interval_s)
        return self.backend


async def bridge_state(request: Request) -> BridgeState:
    """FastAPI dependency: the app's `BridgeState`. A coroutine so that FastAPI calls it on the
    event loop (a plain function would be run in its thread pool)."""
    return request.app.state.bridge
