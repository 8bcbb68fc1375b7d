"""`genserve serve` as a child of this process, for the tools that measure a live server:
`LiveServer` starts it on free localhost ports, waits for its ready line, reads its `/metrics`,
waits for it to go idle, and stops it.

Used by `loadgen.calibrate`, `loadgen.live_policies` and the live benchmarks (`benchmarks.server`,
`benchmarks.balancer`, `benchmarks.prefix_cache`, `benchmarks.peer`). The server is the venv's
`genserve` console script beside `sys.executable` when it exists, else
`python -m genserve.deploy.cli`.
"""

from __future__ import annotations

import pathlib
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from genserve.common.ports import free_port
from loadgen.metrics import scrape_metrics, wait_idle

QUEUE_BUDGET_S = 60.0          # --queue-budget-s unless told: long enough that nothing is refused
START_TIMEOUT_S = 300.0


class LiveServer:
    """`genserve serve` on free localhost ports, started and stopped by this process."""

    def __init__(self, queue_budget_s: float | None = QUEUE_BUDGET_S, extra_args: Sequence[str] = (),
                 start_timeout_s: float = START_TIMEOUT_S) -> None:
        """`queue_budget_s`: the server's `--queue-budget-s` (seconds of queued work before 429s);
        None leaves genserve's default. `extra_args`: more `genserve serve` flags."""
        self.port, self.grpc_port, self.metrics_port = free_port(), free_port(), free_port()
        exe = pathlib.Path(sys.executable).with_name("genserve")
        cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "genserve.deploy.cli"]
        self.argv = cmd + ["serve", "--port", str(self.port), "--grpc-port", str(self.grpc_port),
                           "--metrics-port", str(self.metrics_port)]
        if queue_budget_s is not None:
            self.argv += ["--queue-budget-s", f"{queue_budget_s:g}"]
        self.argv += list(extra_args)
        self.proc: subprocess.Popen | None = None
        self.url = f"http://127.0.0.1:{self.port}"
        self.start_timeout_s = start_timeout_s

    def __enter__(self) -> "LiveServer":
        """Start the server and wait for its ready line. Raises RuntimeError (with the output's
        last 40 lines) if it exits, or prints no ready line within `start_timeout_s` seconds,
        even while it prints nothing at all."""
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines: queue.Queue[str | None] = queue.Queue()
        started = threading.Event()

        def pump(stdout) -> None:       # drains the pipe for the server's whole life
            for line in stdout:
                if not started.is_set():
                    lines.put(line)
            lines.put(None)             # the server closed its output: it has exited

        threading.Thread(target=pump, args=(self.proc.stdout,), daemon=True).start()
        deadline = time.monotonic() + self.start_timeout_s
        tail: list[str] = []
        while True:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                line = None
            if line is not None and "genserve ready" in line:
                started.set()
                return self
            if line is None or time.monotonic() > deadline:
                self.__exit__(None, None, None)
                raise RuntimeError("genserve did not start within "
                                   f"{self.start_timeout_s:g} s:\n" + "".join(tail))
            tail = (tail + [line])[-40:]

    def metrics(self) -> dict[str, float]:
        """`loadgen.metrics.scrape_metrics` of this server."""
        return scrape_metrics(self.url)

    def wait_idle(self, timeout_s: float = 120.0) -> dict[str, float]:
        """`loadgen.metrics.wait_idle` of this server (TimeoutError when it stays busy)."""
        return wait_idle(self.url, timeout_s)

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()             # the supervisor stops engine and bridge
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
