"""Process supervision for `genserve serve`: start children, restart the ones that die with
back-off, stop them in stages on SIGINT/SIGTERM, and the readiness polls it waits on.

Each child is a process as it would be a container. A child that dies is restarted with
exponential back-off (1 s doubling to 30 s; a child that ran for a minute starts again from 1 s).
On SIGINT/SIGTERM the children stop stage by stage: SIGTERM, then up to their `stop_timeout_s`,
then SIGKILL. Imports no torch.
"""

from __future__ import annotations

import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

BACKOFF_START_S = 1.0
BACKOFF_MAX_S = 30.0
HEALTHY_RUN_S = 60.0          # a child that ran this long restarts with the initial back-off
# While the service is not ready after the timeout, how long each supervision pass polls it (s).
LATE_READY_POLL_S = 0.5
STOP_TIMEOUT_S = 15.0         # after SIGTERM (and the engine's drain grace): then SIGKILL


@dataclass
class Child:
    """One supervised process: its command, the live process, and its back-off state.

    `stop_timeout_s` is how long it may take to exit after SIGTERM before it is killed, seconds.
    """

    name: str
    argv: list[str]
    stop_timeout_s: float = STOP_TIMEOUT_S
    stage: int = 0                # SIGTERM order: lower stages stop first, a stage's children together
    proc: subprocess.Popen | None = None
    backoff_s: float = BACKOFF_START_S
    restart_at: float = 0.0
    started_at: float = field(default=0.0)

    def start(self) -> None:
        # Its own process group: a terminal's Ctrl-C (sent to the foreground group) reaches only
        # the supervisor, which stops the children in order.
        self.proc = subprocess.Popen(self.argv, process_group=0)
        self.started_at = time.monotonic()
        print(f"genserve: started {self.name} (pid {self.proc.pid})", flush=True)


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


def wait_http_ok(url: str, timeout_s: float) -> bool:
    """Poll GET `url` until it answers 200 or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1.0) as reply:
                if reply.status == 200:
                    return True
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.25)
    return False


def supervise(children: list[Child], ready: Callable[[float], bool], ready_message: str,
              ready_timeout_s: float) -> int:
    """Start `children`, supervise them until SIGINT/SIGTERM, then stop them stage by stage (lower
    `Child.stage` first, a stage's children together). Returns the exit code (0).

    Args:
        children: the processes, in start order.
        ready: called after the start with a timeout in seconds; True once the service answers
            (then `ready_message` is printed).
        ready_message: what to print once ready (also when that is only after the timeout).
        ready_timeout_s: how long `ready` may wait before "not ready after ... still trying" is
            printed; supervision goes on, and `ready` is polled until the service answers.
    """
    stopping = False

    def stop(signum, frame):  # noqa: ARG001
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    for child in children:
        child.start()
    announced = ready(ready_timeout_s)
    if announced:
        print(ready_message, flush=True)
    else:
        print(f"genserve: not ready after {ready_timeout_s:g} s; still trying", flush=True)
    while not stopping:
        if not announced and ready(LATE_READY_POLL_S):   # ready late: say so, for whoever waits
            announced = True
            print(ready_message, flush=True)
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
    for stage in sorted({child.stage for child in children}):
        stop_children([child for child in children if child.stage == stage])
    return 0


def stop_children(children: list[Child]) -> None:
    """SIGTERM every child of `children` at once, wait up to each one's `stop_timeout_s`, then
    SIGKILL the ones still running."""
    running = [c for c in children if c.proc is not None and c.proc.poll() is None]
    for child in running:
        child.proc.terminate()
    start = time.monotonic()
    for child in running:
        try:
            child.proc.wait(max(child.stop_timeout_s - (time.monotonic() - start), 0.0))
        except subprocess.TimeoutExpired:
            print(f"genserve: {child.name} did not stop in {child.stop_timeout_s:g} s; killing it",
                  flush=True)
            child.proc.kill()
            child.proc.wait()
