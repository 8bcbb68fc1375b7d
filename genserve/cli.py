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

BACKOFF_START_S = 1.0
BACKOFF_MAX_S = 30.0
HEALTHY_RUN_S = 60.0          # a child that ran this long restarts with the initial back-off
STOP_TIMEOUT_S = 15.0         # after SIGTERM (and the engine's drain grace): then SIGKILL


@dataclass
class Child:
    """One supervised process: its command, the live process, and its back-off state."""

    name: str
    argv: list[str]
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


def serve(args: argparse.Namespace) -> int:
    """Run engine + bridge until interrupted. Returns the exit code."""
    target = f"127.0.0.1:{args.grpc_port}"
    engine_argv = [sys.executable, "-m", "service", "--host", "127.0.0.1", "--port", str(args.grpc_port),
                   "--dtype", args.dtype, "--kv-pool-gib", str(args.kv_pool_gib),
                   "--queue-budget-s", str(args.queue_budget_s), "--metrics-port", str(args.metrics_port),
                   "--drain-grace-s", str(args.drain_grace_s), "--threads", str(args.threads)]
    if args.model:
        engine_argv += ["--model", args.model]
    if args.num_blocks:
        engine_argv += ["--num-blocks", str(args.num_blocks)]
    bridge_argv = [sys.executable, "-m", "bridge", "--grpc-target", target, "--host", args.host,
                   "--port", str(args.port), "--log-level", "warning",
                   "--engine-metrics-url", f"http://127.0.0.1:{args.metrics_port}/metrics"]
    if args.max_body_bytes is not None:
        bridge_argv += ["--max-body-bytes", str(args.max_body_bytes)]
    children = [Child("engine", engine_argv), Child("bridge", bridge_argv)]
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
    engine, bridge = children
    stop_child(engine, args.drain_grace_s + STOP_TIMEOUT_S)   # drains while the bridge answers 503
    stop_child(bridge, STOP_TIMEOUT_S)
    return 0


def stop_child(child: Child, timeout_s: float) -> None:
    """SIGTERM `child`, wait up to `timeout_s`, then SIGKILL."""
    if child.proc is None or child.proc.poll() is not None:
        return
    child.proc.terminate()
    try:
        child.proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        print(f"genserve: {child.name} did not stop in {timeout_s:g} s; killing it", flush=True)
        child.proc.kill()
        child.proc.wait()


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `genserve` command."""
    parser = argparse.ArgumentParser(prog="genserve")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("serve", help="start engine + bridge on localhost")
    p.add_argument("--host", default="127.0.0.1", help="bridge address")
    p.add_argument("--port", type=int, default=8000, help="bridge (REST+SSE) port")
    p.add_argument("--grpc-port", type=int, default=50051, help="engine gRPC port")
    p.add_argument("--metrics-port", type=int, default=9400, help="engine Prometheus port")
    p.add_argument("--model", default=None, help="GGUF file (default: the embedded SmolLM2-135M)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--num-blocks", type=int, default=None, help="KV pool size in blocks")
    p.add_argument("--kv-pool-gib", type=float, default=2.0)
    p.add_argument("--queue-budget-s", type=float, default=2.0)
    p.add_argument("--drain-grace-s", type=float, default=30.0,
                   help="on SIGTERM, how long open streams may run on before they are ended")
    p.add_argument("--ready-timeout-s", type=float, default=180.0)
    p.add_argument("--threads", type=int, default=0,
                   help="torch intra-op threads of the engine (0: every usable core)")
    p.add_argument("--max-body-bytes", type=int, default=None,
                   help="largest request body the bridge reads, bytes (413 above; default 1 MiB)")
    args = parser.parse_args(argv)
    return serve(args)


if __name__ == "__main__":
    sys.exit(main())
