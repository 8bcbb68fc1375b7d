"""The engine process: load the model, start the scheduler thread, serve gRPC.

Life cycle:

1. The gRPC server starts at once with health NOT_SERVING; `Generate` answers UNAVAILABLE
   ("engine is loading") until the model is loaded and calibrated, then health turns SERVING.
2. SIGTERM or SIGINT drains: health NOT_SERVING, new requests UNAVAILABLE, open streams run to
   their end for up to `drain_grace_s`; streams still open then end with UNAVAILABLE ("server
   shutting down") and their requests are cancelled. Exit code 0.
3. If the engine loop fails (say a forward pass raises), every open stream has already received
   its error (UNAVAILABLE with the failure's message); the process flushes them and exits with
   code 1, so a supervisor (`genserve serve`, Kubernetes) restarts it.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import start_http_server

from engine.config import EngineConfig
from engine.runner.builder import LoadedEngine, build_engine
from genserve.common import keepalive
from genserve.common.ports import PortInUse, check_ports_free
from genserve.common.telemetry import setup_logging, setup_tracing
from genserve.common.tool_parsers import AUTO, choose_tool_call_parser
from genserve.v1 import generate_pb2 as pb, generate_pb2_grpc as pb_grpc
from service.auth import Authenticator
from service.chat import template_for
from service.command_line import (DRAIN_GRACE_S, HelpFormatter, add_engine_args, config_from_args,
                                  options_from_args)
from service.faults import FailingExecutor, fault_settings
from service.metrics import EngineMetrics
from service.reflection import enable_server_reflection
from service.servicer import GenerateServicer, MAX_BUFFERED_EVENTS
from service.validation import Validator

log = logging.getLogger("genserve.service")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GenerateService"].full_name
FAILURE_FLUSH_S = 5.0         # engine failure: how long to let open streams send their error
ENGINE_POLL_S = 0.05          # how often the server checks that the scheduler thread lives
GIL_SWITCH_INTERVAL_S = 0.0005  # sys.setswitchinterval for the engine process (see main)

EXIT_OK, EXIT_ENGINE_FAILED, EXIT_LOAD_FAILED, EXIT_PORT_IN_USE = 0, 1, 2, 3
# Bind the gRPC port exclusively: gRPC's default SO_REUSEPORT would let a second engine bind a
# port that one already serves, and the kernel would split new connections between the two.
GRPC_SERVER_OPTIONS = (("grpc.so_reuseport", 0),)

Builder = Callable[[EngineConfig, "str | None"], LoadedEngine]


class EngineServer:
    """One engine process's gRPC server, health, metrics and life cycle (see the module doc).

    Args:
        config: engine dials.
        host, port: where to serve gRPC (port 0: any free port; see `port` after `start`).
        model_path: the model, a `--model` value (`genserve.common.model_source`; None: the embedded one).
        auth: API keys (default: from the environment).
        metrics_port: serve Prometheus metrics on it (None: off).
        drain_grace_s: how long SIGTERM lets open streams run on.
        fail_at_step, fail_once_file: fault injection (see `service.faults`).
        max_buffered_events: bound of each request's output buffer.
        build: loads the engine (tests pass one that builds a simulated engine).
        tracer: OpenTelemetry tracer for request spans (default: the global provider's).
        keepalive_interval_s: the callers' HTTP/2 ping interval, seconds; pings that often are
            accepted (`genserve.common.keepalive.server_options`), so a silent stream survives.
        tool_call_parser: ``--tool-call-parser``: "auto" or a format name; the format chosen at
            load (`genserve.common.tool_parsers.choose_tool_call_parser`) is reported in
            ``InfoResponse.tool_call_parser``.
    """

    def __init__(self, config: EngineConfig, host: str = "127.0.0.1", port: int = 50051, *,
                 model_path: str | None = None, auth: Authenticator | None = None,
                 metrics_port: int | None = None, drain_grace_s: float = DRAIN_GRACE_S,
                 fail_at_step: int | None = None, fail_once_file: str | None = None,
                 max_buffered_events: int = MAX_BUFFERED_EVENTS,
                 build: Builder = build_engine, tracer=None,
                 keepalive_interval_s: float = keepalive.PING_INTERVAL_S,
                 tool_call_parser: str = AUTO,
                 lora_modules: tuple[tuple[str, str], ...] = (), enable_lora: bool = False) -> None:
        self.config = config
        self.tool_call_parser = tool_call_parser
        self.lora_modules = tuple(lora_modules)
        self.enable_lora = enable_lora or bool(lora_modules)
        self.host = host
        self.requested_port = port
        self.model_path = model_path
        self.metrics_port = metrics_port
        self.drain_grace_s = drain_grace_s
        self.fail_at_step = fail_at_step
        self.fail_once_file = fail_once_file
        self.build = build
        self.server = grpc.aio.server(
            options=GRPC_SERVER_OPTIONS + keepalive.server_options(keepalive_interval_s))
        self.health = EngineHealth(lambda: self.loaded is None or self.loaded.engine.alive)
        self.servicer = GenerateServicer(auth=auth or Authenticator.from_env(),
                                         max_buffered_events=max_buffered_events, tracer=tracer)
        self.loaded: LoadedEngine | None = None
        self.metrics: EngineMetrics | None = None
        self.port = 0

    @property
    def engine(self):
        return None if self.loaded is None else self.loaded.engine

    async def start(self) -> None:
        """Serve gRPC (health NOT_SERVING, Generate UNAVAILABLE) before anything is loaded.

        Raises:
            PortInUse: the gRPC port or the metrics port is taken (nothing was started).
        """
        if self.metrics_port is not None:
            check_ports_free([("engine metrics", self.host, self.metrics_port)])
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME), self.server)
        pb_grpc.add_GenerateServiceServicer_to_server(self.servicer, self.server)
        try:
            self.port = self.server.add_insecure_port(f"{self.host}:{self.requested_port}")
        except RuntimeError as exc:          # grpc: "Failed to bind to address ..."
            raise PortInUse(self.host, self.requested_port, "engine gRPC") from exc
        self.servicer.engine_label = f"{self.host}:{self.port} pid {os.getpid()}"
        await self.server.start()
        log.info("engine gRPC listening on %s:%d (loading the model)", self.host, self.port)

    async def load(self) -> None:
        """Load and calibrate the model on a daemon thread, then start serving it.

        The loading thread ends once the model is built, before the engine's own thread steps,
        so the process keeps one OpenMP worker pool, the engine thread's (`Engine.start`)."""
        loaded = await _on_daemon_thread(self.build, self.config, self.model_path)
        engine = loaded.engine
        self.config = engine.config          # its max_context lowered where the KV pool is small
        adapters = getattr(engine.executor, "adapters", None)     # the model runner's registry
        for name, path in self.lora_modules:    # raises ValueError naming the adapter's problem
            if adapters is None:
                raise ValueError("--lora-modules: this engine's executor serves no LoRA adapters")
            adapter = await asyncio.to_thread(adapters.load, name, path)
            log.info("LoRA adapter %r loaded from %s (rank %d, %s)", name, path, adapter.rank,
                     ", ".join(adapter.targets))
        if self.fail_at_step is not None:
            engine.executor = FailingExecutor(engine.executor, self.fail_at_step, self.fail_once_file)
            log.warning("fault injection armed: forward pass %d will raise (once file: %s)",
                        self.fail_at_step, self.fail_once_file)
        template = template_for(loaded.tokenizer)
        # A named parser for a template without tool syntax fails the load (ValueError).
        parser = choose_tool_call_parser(getattr(loaded.args, "architecture", ""),
                                         template is not None and template.defines_tools, self.tool_call_parser)
        info = pb.InfoResponse(model_name=loaded.model_name, max_context=self.config.max_context,
                               max_new_tokens=self.config.max_new_tokens,
                               vocab_size=loaded.args.vocab_size, block_size=self.config.block_size,
                               num_kv_blocks=engine.pool.num_blocks, tool_call_parser=parser)
        log.info("tool calls: %s", f"the {parser} format of the model's chat template" if parser
                 else "the generic tool prompt (the chat template defines no tool calls)")
        self.metrics = EngineMetrics(engine)
        if self.metrics_port is not None:
            start_http_server(self.metrics_port, addr=self.host, registry=self.metrics.registry)
        self.servicer.adapters = adapters
        self.servicer.lora_enabled = self.enable_lora and adapters is not None
        now = int(time.time())
        self.servicer.adapter_loaded_s = {"": now, **{name: now for name, _ in self.lora_modules}}
        self.servicer.attach(engine, loaded.tokenizer,
                             Validator(self.config, loaded.tokenizer, template),
                             info, self.metrics)
        self.loaded = loaded
        # What is loaded now (model, tokenizer, tables) lives as long as the process: moved out of
        # the collector's generations, the full collections that Python runs as the steps allocate
        # no longer walk it (they took ~4 % of a one-row decode step).
        gc.freeze()
        engine.start()
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        log.info("engine serving gRPC on %s:%d (%d KV blocks)", self.host, self.port, engine.pool.num_blocks)

    async def run(self, stop: asyncio.Event) -> int:
        """Load, serve until `stop` is set (then drain) or the engine fails. Returns the exit code
        (`EXIT_PORT_IN_USE` at once, with the port logged, when a port is taken)."""
        try:
            await self.start()
        except PortInUse as exc:
            log.error("%s", exc)
            return EXIT_PORT_IN_USE
        load = asyncio.ensure_future(self.load())
        stopped = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({load, stopped}, return_when=asyncio.FIRST_COMPLETED)
            if not load.done():
                log.info("stopped while loading")
                await self.server.stop(grace=1.0)
                return EXIT_OK
            if load.exception() is not None:
                log.error("engine failed to load: %r", load.exception())
                await self.server.stop(grace=1.0)
                return EXIT_LOAD_FAILED
            failed = asyncio.ensure_future(self._engine_failed())
            await asyncio.wait({failed, stopped}, return_when=asyncio.FIRST_COMPLETED)
            failed.cancel()
            if stopped.done():
                await self.drain()
            else:
                await self.fail()
            return EXIT_ENGINE_FAILED if self.engine.error is not None else EXIT_OK
        finally:
            stopped.cancel()
            load.cancel()

    async def drain(self) -> None:
        """Stop admitting, let open streams finish for up to `drain_grace_s`, then stop."""
        self.servicer.draining = True
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        log.info("draining: %d open streams, grace %.0f s", self.servicer.num_open, self.drain_grace_s)
        if not await self.servicer.wait_idle(self.drain_grace_s):
            n = self.servicer.abort_all(
                grpc.StatusCode.UNAVAILABLE,
                f"server shutting down: the {self.drain_grace_s:g} s drain grace period ended")
            log.warning("drain grace period over: ended %d open streams", n)
            await self.servicer.wait_idle(FAILURE_FLUSH_S)
        await self.server.stop(grace=1.0)
        self.engine.stop()
        log.info("drained; exiting")

    async def fail(self) -> None:
        """The engine loop failed: let every open stream send its error, then stop."""
        log.error("engine loop failed (%r): ending %d open streams with UNAVAILABLE and exiting",
                  self.engine.error, self.servicer.num_open)
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        if not await self.servicer.wait_idle(FAILURE_FLUSH_S):
            self.servicer.abort_all(grpc.StatusCode.UNAVAILABLE, f"engine failure: {self.engine.error}")
            await self.servicer.wait_idle(1.0)
        await self.server.stop(grace=1.0)

    async def _engine_failed(self) -> None:
        """Return once the scheduler thread has died (its `error` says why)."""
        while self.engine.alive:
            await asyncio.sleep(ENGINE_POLL_S)
        if self.engine.error is None:       # the thread ended without an error: treat it as one
            self.engine.error = RuntimeError("the scheduler thread stopped")

    async def _set_health(self, status) -> None:
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)


class EngineHealth(health.aio.HealthServicer):
    """grpc.health.v1 whose Check answers NOT_SERVING from the moment the engine has failed.

    `Server.fail` sets NOT_SERVING once it notices the failure (it polls every ENGINE_POLL_S),
    but the failure reaches clients first, as errors on their open streams; a client that then
    asks for health must not be told SERVING in between (the bridge's /health would say 200).

    Args:
        alive: False once the engine can no longer serve (`Engine.alive`).
    """

    def __init__(self, alive: Callable[[], bool]) -> None:
        super().__init__()
        self._alive = alive

    async def Check(self, request: health_pb2.HealthCheckRequest, context):
        reply = await super().Check(request, context)
        if reply.status == health_pb2.HealthCheckResponse.SERVING and not self._alive():
            return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.NOT_SERVING)
        return reply


async def _on_daemon_thread(fn, *args):
    """Run `fn(*args)` on a daemon thread (a slow load never blocks process exit)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(setter, value) -> None:
        if not future.done():
            setter(value)

    def work() -> None:
        try:
            result = fn(*args)
        except BaseException as exc:  # noqa: BLE001 — handed to the waiting coroutine
            loop.call_soon_threadsafe(settle, future.set_exception, exc)
        else:
            loop.call_soon_threadsafe(settle, future.set_result, result)

    threading.Thread(target=work, name="genserve-load", daemon=True).start()
    return await future


async def serve(config: EngineConfig, host: str, port: int, model_path: str | None = None,
                auth: Authenticator | None = None, metrics_port: int | None = None,
                **options) -> int:
    """Run one engine server until SIGINT/SIGTERM (drain) or an engine failure.

    With `metrics_port`, Prometheus metrics are served at http://host:metrics_port/metrics.
    `options` go to `EngineServer`. Returns the process exit code.
    """
    server = EngineServer(config, host, port, model_path=model_path, auth=auth,
                          metrics_port=metrics_port, **options)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return await server.run(stop)


def build_parser() -> argparse.ArgumentParser:
    """The parser of `python -m service`: where to serve, the service's own flags, and the engine
    process's flags shared with `genserve serve` (`service.command_line.add_engine_args`)."""
    parser = argparse.ArgumentParser(prog="python -m service", description=__doc__,
                                     formatter_class=HelpFormatter)
    parser.add_argument("--host", default="127.0.0.1", help="gRPC address. Default: %(default)s.")
    parser.add_argument("--port", type=int, default=50051,
                        help="gRPC port (0: any free port). Default: %(default)s.")
    parser.add_argument("--max-buffered-events", type=int, default=MAX_BUFFERED_EVENTS,
                        help="per-request output buffer bound; a reader that falls this far "
                             "behind is cancelled. Default: %(default)s.")
    parser.add_argument("--fail-at-step", type=int, default=None,
                        help="FAULT INJECTION (tests only): forward pass K raises "
                             "(env GENSERVE_FAIL_AT_STEP)")
    parser.add_argument("--fail-once-file", default=None,
                        help="FAULT INJECTION: fire only while this file does not exist; create it "
                             "when firing (env GENSERVE_FAIL_ONCE_FILE)")
    add_engine_args(parser)
    return parser


def main(argv: list[str] | None = None) -> None:
    """`python -m service --port 50051`: run the engine's gRPC server; exits 1 if the engine fails,
    3 (naming the port) if the gRPC or metrics port is already taken.

    Invalid engine dials end it at once with exit code 2 and the reason (argparse's usage error).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
        options = options_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    # The scheduler thread takes the GIL back after every torch op of a step; with Python's
    # default 5 ms switch interval the event loop thread can hold it that long while streams
    # are busy. 0.5 ms measured ≈ 10 % more live throughput at 32 streams on 2 cores.
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    setup_logging(logging.INFO)               # JSON lines (GENSERVE_LOG_FORMAT=text for a terminal)
    setup_tracing("genserve-engine")          # GENSERVE_OTEL_EXPORTER=off|console|otlp
    fail_at_step, once_file = fault_settings(args.fail_at_step, args.fail_once_file)
    code = asyncio.run(serve(config, args.host, args.port, options.model_path,
                             metrics_port=options.metrics_port, drain_grace_s=options.drain_grace_s,
                             fail_at_step=fail_at_step, fail_once_file=once_file,
                             max_buffered_events=args.max_buffered_events,
                             keepalive_interval_s=options.keepalive_interval_s,
                             tool_call_parser=options.tool_call_parser,
                             lora_modules=options.lora_modules, enable_lora=options.enable_lora))
    sys.exit(code)
