"""HTTP/2 keepalive between genserve's hops, from one interval.

Envoy pings each engine connection every `PING_INTERVAL_S` (its cluster's
`http2_protocol_options.connection_keepalive`, chart value `envoy.engines.keepaliveIntervalSeconds`),
and the bridge's gRPC channel pings its target just as often. A gRPC server that keeps gRPC's
defaults accepts a ping on a connection that sent no data at most once per 5 minutes
(gRPC core's `GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS`, whose string is
`grpc.http2.min_ping_interval_without_data_ms`: the longer name is not a channel argument and is
silently ignored) and answers the third early one with
GOAWAY `too_many_pings` (`grpc.http2.max_ping_strikes` = 2), which ends every stream on the
connection with UNAVAILABLE: a stream that waits silently for ~3 ping intervals (a queued request,
a long prefill, a scheduler watch) would die. So the engine's server accepts pings every half
interval (the senders' own pacing is exact, Envoy adds up to 15 % jitter on top), with or without
calls open. Interval and timeout here are the one source: `genserve serve` passes them to Envoy's
template, the engines and the bridge; the chart's default equals them (tests/deploy checks it).

Torch-free; nothing here is mutable.
"""

from __future__ import annotations

PING_INTERVAL_S = 30.0
"""Seconds between keepalive pings on an idle HTTP/2 connection (Envoy → engine, bridge → its
gRPC target). 30 s stays under the common 60 s idle cut of load balancers and NAT tables."""

PING_TIMEOUT_S = 5.0
"""Seconds a ping may go unanswered before the sender closes the connection."""

MAX_PING_STRIKES = 2
"""Pings earlier than the server allows before it answers GOAWAY too_many_pings (gRPC's own
default, stated here so the policy is read in one place)."""


def server_options(ping_interval_s: float = PING_INTERVAL_S) -> tuple[tuple[str, int], ...]:
    """gRPC server channel arguments that accept keepalive pings sent every `ping_interval_s`
    seconds (by Envoy or a `channel_options` client), with or without calls open.

    Raises:
        ValueError: `ping_interval_s` is not positive.
    """
    if not ping_interval_s > 0:
        raise ValueError(f"ping_interval_s must be > 0, got {ping_interval_s}")
    return (
        ("grpc.http2.min_ping_interval_without_data_ms", int(ping_interval_s * 1000 / 2)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_ping_strikes", MAX_PING_STRIKES),
    )


def channel_options(ping_interval_s: float = PING_INTERVAL_S,
                    ping_timeout_s: float = PING_TIMEOUT_S) -> tuple[tuple[str, int], ...]:
    """gRPC client channel arguments that ping every `ping_interval_s` seconds while the
    connection is idle, as Envoy does, and drop it when a ping is unanswered for `ping_timeout_s`.

    Raises:
        ValueError: an interval or timeout is not positive.
    """
    if not (ping_interval_s > 0 and ping_timeout_s > 0):
        raise ValueError(f"ping interval and timeout must be > 0, got {ping_interval_s}, {ping_timeout_s}")
    return (
        ("grpc.keepalive_time_ms", int(ping_interval_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(ping_timeout_s * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    )
