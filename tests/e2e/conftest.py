"""A live genserve (engine + bridge) started the way the README's `make serve` starts it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

START_TIMEOUT_S = 240.0
KEYED_MAX_BODY_BYTES = 65_536   # keyed_server's body limit


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    """Addresses of a running `genserve serve`."""

    base_url: str
    grpc_target: str
    process: subprocess.Popen
    output: list[str]                    # the supervisor's and its children's output so far

    def metrics(self) -> dict[str, float]:
        """Every sample of GET /metrics as {"name{label=value,...}": value}."""
        text = httpx.get(f"{self.base_url}/metrics", timeout=10).text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out

    def wait_idle(self, timeout_s: float = 30.0) -> dict[str, float]:
        """Poll /metrics until no request runs or waits; returns the last metrics."""
        deadline = time.monotonic() + timeout_s
        while True:
            m = self.metrics()
            if m["genserve_running_rows"] == 0 and m["genserve_queue_depth"] == 0:
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"engine not idle after {timeout_s} s: {m['genserve_running_rows']} rows")
            time.sleep(0.1)


def start_server(*extra: str, env: dict[str, str] | None = None):
    """Start `genserve serve` on free ports; yields a Server, stops it afterwards."""
    port, grpc_port, metrics_port = free_port(), free_port(), free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "genserve.cli", "serve", "--port", str(port), "--grpc-port", str(grpc_port),
         "--metrics-port", str(metrics_port), "--kv-pool-gib", "0.5", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, **(env or {})})
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    output = []
    while True:
        line = proc.stdout.readline()
        output.append(line)
        if "genserve ready" in line:
            break
        if proc.poll() is not None or time.monotonic() > deadline or not line:
            proc.kill()
            raise RuntimeError("genserve did not start:\n" + "".join(output[-40:]))
    assert httpx.get(f"{base}/health", timeout=10).status_code == 200
    # Read the rest of the output in the background so the pipe never fills (last lines kept).
    import threading

    def keep_reading() -> None:
        for line in proc.stdout:
            output.append(line)
            if len(output) > 5000:
                del output[:1000]

    threading.Thread(target=keep_reading, daemon=True).start()
    yield Server(base, f"127.0.0.1:{grpc_port}", proc, output)
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="session")
def server():
    """The local default: no API keys, a queue budget (an hour of device time) that the isolation
    test's 1,000 concurrent requests and the soak never reach: CPU steps are slow and the cost
    model calibrates itself from them (429s are tested on `keyed_server`)."""
    yield from start_server("--queue-budget-s", "3600")


API_KEYS = {"key-alice": "alice", "key-bob": "bob"}


@pytest.fixture(scope="session")
def keyed_server():
    """API keys configured through GENSERVE_API_KEYS; a small queue budget to provoke 429s; request
    bodies up to KEYED_MAX_BODY_BYTES (`genserve serve --max-body-bytes`)."""
    keys = ",".join(f"{k}={v}" for k, v in API_KEYS.items())
    yield from start_server("--queue-budget-s", "2", "--num-blocks", "256",
                            "--max-body-bytes", str(KEYED_MAX_BODY_BYTES), env={"GENSERVE_API_KEYS": keys})


def sse_events(lines) -> list:
    """`data:` payloads of an SSE line iterator, JSON-decoded ("[DONE]" kept as a string)."""
    out = []
    for line in lines:
        if line.startswith("data:"):
            data = line[5:].strip()
            out.append(data if data == "[DONE]" else json.loads(data))
    return out
