"""`python -m bridge --grpc-target HOST:PORT [--host H] [--port P] [--model-name NAME]`.

Each option also reads an environment variable (GENSERVE_GRPC_TARGET,
BRIDGE_HOST, BRIDGE_PORT, GENSERVE_MODEL_NAME, GENSERVE_MAX_BODY_BYTES).
Logs are JSON lines (GENSERVE_LOG_FORMAT=text for a terminal); traces go where
GENSERVE_OTEL_EXPORTER says (off, console, otlp; see genserve.common.telemetry).
"""

from __future__ import annotations

import argparse
import os

from bridge.app import DEFAULT_MODEL_NAME, MAX_BODY_BYTES
from bridge.server import run
from genserve.common.keepalive import PING_INTERVAL_S
from genserve.common.telemetry import setup_logging, setup_tracing


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bridge", description="REST+SSE -> gRPC bridge")
    parser.add_argument("--grpc-target", default=os.environ.get("GENSERVE_GRPC_TARGET", "localhost:50051"),
                        help="host:port of the GenerateService (default: %(default)s)")
    parser.add_argument("--host", default=os.environ.get("BRIDGE_HOST", "0.0.0.0"))
    parser.add_argument("--port", type=int, default=int(os.environ.get("BRIDGE_PORT", "8000")))
    parser.add_argument("--model-name", default=os.environ.get("GENSERVE_MODEL_NAME", DEFAULT_MODEL_NAME))
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--engine-metrics-url", action="append", default=None,
                        help="an engine's /metrics URL, shown in the bridge's /metrics too; repeat it "
                             "once per engine replica (their samples then get a `replica` label, the "
                             "flag's position from 0). Default: GENSERVE_ENGINE_METRICS_URL, else none")
    parser.add_argument("--max-body-bytes", type=int,
                        default=int(os.environ.get("GENSERVE_MAX_BODY_BYTES", MAX_BODY_BYTES)),
                        help="largest request body, bytes (413 above; default: %(default)s)")
    parser.add_argument("--keepalive-interval-s", type=float, default=PING_INTERVAL_S,
                        help="HTTP/2 keepalive ping interval of the gRPC channel, seconds "
                             "(default: %(default)s)")
    args = parser.parse_args(argv)
    engine_metrics_urls = args.engine_metrics_url or \
        [url for url in [os.environ.get("GENSERVE_ENGINE_METRICS_URL")] if url]
    setup_logging(args.log_level.upper())
    setup_tracing("genserve-bridge")
    run(args.grpc_target, args.host, args.port, model_name=args.model_name, log_level=args.log_level,
        engine_metrics_url=engine_metrics_urls, max_body_bytes=args.max_body_bytes,
        grpc_ping_interval_s=args.keepalive_interval_s)


if __name__ == "__main__":
    main()
