"""`genserve serve`: start the engine (gRPC) and the bridge (REST+SSE) on localhost, supervised.

The engine and the bridge run as two child processes, as they would in two containers. The
supervisor restarts a child that dies, with exponential back-off (1 s doubling to 30 s; a child
that ran for a minute starts again from 1 s). While the engine is down the bridge answers 503
with Retry-After and reconnects on its own when the engine is back.

SIGINT/SIGTERM stop both in order: the engine first, which drains (refuses new requests, lets
open streams finish for up to `--drain-grace-s`), while the bridge still answers (503 for new
requests); then the bridge. The bridge never imports torch.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from service.command_line import (HelpFormatter, add_engine_args, config_from_args, options_from_args,
                                  service_argv)

BACKOFF_START_S = 1.0
BACKOFF_MAX_S = 30.0
HEALTHY_RUN_S = 60.0          # a child that ran this long restarts with the initial back-off
STOP_TIMEOUT_S = 15.0         # after SIGTERM (and the engine's drain grace): then SIGKILL
ENGINE_HOST = "127.0.0.1"     # the engine child serves gRPC on localhost only; the bridge faces out
ENGINE_METRICS_PORT = 9400    # --metrics-port's default here (python -m service: none unless given)


@dataclass
class Child:
    """One supervised process: its command, the live process, and its back-off state.

    `stop_timeout_s` is how long it may take to exit after SIGTERM before it is killed, seconds.
    """

    name: str
    argv: list[str]
    stop_timeout_s: float = STOP_TIMEOUT_S
    proc: subprocess.Popen | None = None
    backoff_s: float = BACKOFF_START_S
    restart_at: float = 0.0
    started_at: float = field(default=0.0)

    def start(self) -> None:
        self.proc = subprocess.Popen(self.argv)
        self.started_at = time.monotonic()


def wait_engine_ready(target: str, timeout_s: float) -> bool:
    """Poll grpc.health.v1 on `target` until SERVING or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status == \
                        health_pb2.HealthCheckResponse.SERVING:
                    return True
            except grpc.RpcError:
                pass
            time.sleep(0.25)
    return False


def engine_argv(args: argparse.Namespace) -> list[str]:
    """The engine child's command line for the parsed `genserve serve` flags: `python -m service`
    with the same engine flags (`service.command_line.service_argv`), serving gRPC on localhost.

    Raises:
        ValueError: the engine dials are not a valid EngineConfig (the message says which).
    """
    argv = service_argv(config_from_args(args), options_from_args(args), host=ENGINE_HOST,
                        port=args.grpc_port)
    return [sys.executable, "-m", "service", *argv]


def bridge_argv(args: argparse.Namespace) -> list[str]:
    """The bridge child's command line for the parsed `genserve serve` flags."""
    argv = [sys.executable, "-m", "bridge", "--grpc-target", f"{ENGINE_HOST}:{args.grpc_port}",
            "--host", args.host, "--port", str(args.port), "--log-level", "warning",
            "--engine-metrics-url", f"http://{ENGINE_HOST}:{args.metrics_port}/metrics"]
    if args.max_body_bytes is not None:
        argv += ["--max-body-bytes", str(args.max_body_bytes)]
    return argv


def serve(args: argparse.Namespace, children: list[Child]) -> int:
    """Start `children`, supervise them until SIGINT/SIGTERM, then stop them one by one in list
    order (the engine first: it drains while the bridge still answers 503). Returns the exit code."""
    target = f"{ENGINE_HOST}:{args.grpc_port}"
    stopping = False

    def stop(signum, frame):  # noqa: ARG001
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    for child in children:
        child.start()
    if wait_engine_ready(target, args.ready_timeout_s):
        print(f"genserve ready\n  REST+SSE  http://{args.host}:{args.port}/v1/completions\n"
              f"  gRPC      {target}  (genserve.v1.GenerateService)\n"
              f"  health    http://{args.host}:{args.port}/health\n"
              f"  metrics   http://{args.host}:{args.port}/metrics", flush=True)
    else:
        print(f"genserve: engine not ready after {args.ready_timeout_s:g} s; still trying", flush=True)
    while not stopping:
        now = time.monotonic()
        for child in children:
            code = child.proc.poll() if child.proc else None
            if child.proc is not None and code is not None:
                print(f"genserve: {child.name} exited with {code}; restarting in {child.backoff_s:g} s",
                      flush=True)
                child.proc, child.restart_at = None, now + child.backoff_s
                healthy_run = now - child.started_at > HEALTHY_RUN_S
                child.backoff_s = BACKOFF_START_S if healthy_run else min(child.backoff_s * 2, BACKOFF_MAX_S)
            elif child.proc is None and now >= child.restart_at:
                child.start()
        time.sleep(0.2)
    for child in children:
        stop_child(child)
    return 0


def stop_child(child: Child) -> None:
    """SIGTERM `child`, wait up to its `stop_timeout_s`, then SIGKILL."""
    if child.proc is None or child.proc.poll() is not None:
        return
    child.proc.terminate()
    try:
        child.proc.wait(child.stop_timeout_s)
    except subprocess.TimeoutExpired:
        print(f"genserve: {child.name} did not stop in {child.stop_timeout_s:g} s; killing it", flush=True)
        child.proc.kill()
        child.proc.wait()


def build_parser() -> argparse.ArgumentParser:
    """The parser of the `genserve` command and its `serve` subcommand.

    `serve` takes the bridge's flags, the supervisor's, and the engine process's flags shared with
    `python -m service` (`service.command_line.add_engine_args`, which also adds one flag per
    EngineConfig dial).
    """
    parser = argparse.ArgumentParser(prog="genserve")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("serve", help="start engine + bridge on localhost", description=__doc__,
                       formatter_class=HelpFormatter)
    bridge = p.add_argument_group("bridge (REST+SSE)")
    bridge.add_argument("--host", default="127.0.0.1", help="bridge address. Default: %(default)s.")
    bridge.add_argument("--port", type=int, default=8000, help="bridge (REST+SSE) port. Default: %(default)s.")
    bridge.add_argument("--max-body-bytes", type=int, default=None,
                        help="largest request body the bridge reads, bytes (413 above). Default: 1 MiB.")
    supervisor = p.add_argument_group("supervisor")
    supervisor.add_argument("--ready-timeout-s", type=float, default=180.0,
                            help="seconds to wait for the engine's first SERVING before printing that it "
                                 "is not ready yet (supervision goes on). Default: %(default)s.")
    engine = add_engine_args(p, metrics_port=ENGINE_METRICS_PORT)
    engine.add_argument("--grpc-port", type=int, default=50051,
                        help=f"engine gRPC port, on {ENGINE_HOST}. Default: %(default)s.")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `genserve` command. Returns the exit code (2: invalid flags)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        engine = Child("engine", engine_argv(args), stop_timeout_s=args.drain_grace_s + STOP_TIMEOUT_S)
        children = [engine, Child("bridge", bridge_argv(args))]
    except ValueError as exc:
        parser.exit(2, f"genserve {args.command}: error: {exc}\n")
    return serve(args, children)


if __name__ == "__main__":
    sys.exit(main())
