"""Run the bridge with uvicorn: `run(grpc_target, host, port)`."""

from __future__ import annotations

from collections.abc import Sequence

import uvicorn

from bridge.app import DEFAULT_MODEL_NAME, MAX_BODY_BYTES, create_app
from genserve.common.keepalive import PING_INTERVAL_S

KEEP_ALIVE_S = 75
"""Seconds the bridge keeps an idle HTTP/1.1 connection open (uvicorn's `timeout_keep_alive`,
5 s by default). Above Envoy's idle timeout for the bridge cluster (60 s,
charts/genserve/files/envoy.yaml), so Envoy always closes an idle connection first and never
sends a request on one the bridge is closing (that request would be reset: a 503)."""


def run(
    grpc_target: str,
    host: str = "0.0.0.0",
    port: int = 8000,
    *,
    model_name: str = DEFAULT_MODEL_NAME,
    log_level: str = "info",
    engine_metrics_url: str | Sequence[str] | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    grpc_ping_interval_s: float = PING_INTERVAL_S,
) -> None:
    """Serve the bridge on host:port until interrupted, talking to grpc_target.

    uvicorn's own logging setup is skipped (`log_config=None`): its loggers go through the
    root handler, which `genserve.common.telemetry.setup_logging` makes write JSON lines.
    """
    app = create_app(grpc_target, model_name, engine_metrics_url=engine_metrics_url,
                     max_body_bytes=max_body_bytes, grpc_ping_interval_s=grpc_ping_interval_s)
    uvicorn.run(app, host=host, port=port, log_level=log_level, log_config=None,
                timeout_keep_alive=KEEP_ALIVE_S)
