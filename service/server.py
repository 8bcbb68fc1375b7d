"""The engine process: load the model, start the scheduler thread, serve gRPC."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from engine.builder import build_engine
from engine.config import EngineConfig
from genserve.v1 import generate_pb2 as pb
from genserve.v1 import generate_pb2_grpc as pb_grpc
from service.auth import Authenticator
from service.metrics import EngineMetrics
from service.servicer import GenerateServicer
from service.validation import Validator

log = logging.getLogger("genserve.service")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GenerateService"].full_name


async def serve(config: EngineConfig, host: str, port: int, model_path: str | None = None,
                auth: Authenticator | None = None, metrics_port: int | None = None) -> None:
    """Build the engine, serve GenerateService + health + reflection until SIGINT/SIGTERM.

    With `metrics_port`, Prometheus metrics are served at http://host:metrics_port/metrics.
    """
    server = grpc.aio.server()
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    await health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    await health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    loaded = await asyncio.to_thread(build_engine, config, model_path)
    engine = loaded.engine
    info = pb.InfoResponse(model_name=loaded.model_name, max_context=config.max_context,
                           max_new_tokens=config.max_new_tokens, vocab_size=loaded.args.vocab_size,
                           block_size=config.block_size, num_kv_blocks=engine.pool.num_blocks)
    metrics = EngineMetrics(engine)
    if metrics_port is not None:
        start_http_server(metrics_port, addr=host, registry=metrics.registry)
    pb_grpc.add_GenerateServiceServicer_to_server(GenerateServicer(
        engine, loaded.tokenizer, Validator(config, loaded.tokenizer),
        auth or Authenticator.from_env(), info, metrics), server)
    engine.start()
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    await health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
    log.info("engine serving gRPC on %s:%d (%d KV blocks)", host, bound, engine.pool.num_blocks)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await health_servicer.enter_graceful_shutdown()
    await server.stop(grace=5.0)
    engine.stop()


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Flags shared by `python -m service` and `genserve serve`."""
    parser.add_argument("--model", default=None, help="GGUF file (default: the embedded SmolLM2-135M)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--num-blocks", type=int, default=None, help="KV pool size in blocks")
    parser.add_argument("--kv-pool-gib", type=float, default=2.0, help="KV pool budget, GiB")
    parser.add_argument("--queue-budget-s", type=float, default=2.0,
                        help="device-seconds of queued work before 429")


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """EngineConfig from the shared flags."""
    return EngineConfig(dtype=args.dtype, num_blocks=args.num_blocks,
                        kv_pool_bytes=int(args.kv_pool_gib * 1024**3),
                        queue_budget_s=args.queue_budget_s)


def main(argv: list[str] | None = None) -> None:
    """`python -m service --port 50051`: run the engine's gRPC server."""
    parser = argparse.ArgumentParser(prog="python -m service", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=50051)
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="serve Prometheus metrics on this port (default: off)")
    add_engine_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    asyncio.run(serve(config_from_args(args), args.host, args.port, args.model,
                      metrics_port=args.metrics_port))
