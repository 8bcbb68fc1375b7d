"""`python -m bridge --grpc-target HOST:PORT [--host H] [--port P] [--model-name NAME]`.

Each option also reads an environment variable (GENSERVE_GRPC_TARGET,
BRIDGE_HOST, BRIDGE_PORT, GENSERVE_MODEL_NAME).
"""

from __future__ import annotations

import argparse
import os

from bridge.app import DEFAULT_MODEL_NAME
from bridge.server import run


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bridge", description="REST+SSE -> gRPC bridge")
    parser.add_argument("--grpc-target", default=os.environ.get("GENSERVE_GRPC_TARGET", "localhost:50051"),
                        help="host:port of the GenerateService (default: %(default)s)")
    parser.add_argument("--host", default=os.environ.get("BRIDGE_HOST", "0.0.0.0"))
    parser.add_argument("--port", type=int, default=int(os.environ.get("BRIDGE_PORT", "8000")))
    parser.add_argument("--model-name", default=os.environ.get("GENSERVE_MODEL_NAME", DEFAULT_MODEL_NAME))
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--engine-metrics-url", default=os.environ.get("GENSERVE_ENGINE_METRICS_URL"),
                        help="the engine's /metrics URL, shown in the bridge's /metrics too")
    args = parser.parse_args(argv)
    run(args.grpc_target, args.host, args.port, model_name=args.model_name, log_level=args.log_level,
        engine_metrics_url=args.engine_metrics_url)


if __name__ == "__main__":
    main()
