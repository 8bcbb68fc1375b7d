"""Run the bridge with uvicorn: `run(grpc_target, host, port)`."""

from __future__ import annotations

import uvicorn

from bridge.app import DEFAULT_MODEL_NAME, create_app


def run(
    grpc_target: str,
    host: str = "0.0.0.0",
    port: int = 8000,
    *,
    model_name: str = DEFAULT_MODEL_NAME,
    log_level: str = "info",
    engine_metrics_url: str | None = None,
) -> None:
    """Serve the bridge on host:port until interrupted, talking to grpc_target."""
    app = create_app(grpc_target, model_name, engine_metrics_url=engine_metrics_url)
    uvicorn.run(app, host=host, port=port, log_level=log_level)
