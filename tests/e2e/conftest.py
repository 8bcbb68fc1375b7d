"""A live genserve (Envoy + bridge + engine replicas) started the way the README's `make serve`
starts it; `--no-envoy` in a fixture's flags gives the direct layout (bridge -> engine)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx
import pytest

from loadgen.metrics import scrape_metrics, wait_idle
from tests.ports import reserve_ports

START_TIMEOUT_S = 240.0
KEYED_MAX_BODY_BYTES = 65_536   # keyed_server's body limit


@dataclass
class Server:
    """Addresses of a running `genserve serve`."""

    base_url: str
    grpc_target: str                     # the public gRPC address (Envoy's listener, or the engine's)
    process: subprocess.Popen
    output: list[str]                    # the supervisor's and its children's output so far
    engine_targets: list[str] = field(default_factory=list)   # each replica's own gRPC address
    engine_metrics_urls: list[str] = field(default_factory=list)

    def metrics(self) -> dict[str, float]:
        """Every sample of GET /metrics (`loadgen.metrics.scrape_metrics`)."""
        return scrape_metrics(self.base_url)

    def wait_idle(self, timeout_s: float = 30.0, settle_s: float = 0.3) -> dict[str, float]:
        """/metrics once no request runs or waits (`loadgen.metrics.wait_idle`); an
        AssertionError when the engine stays busy for `timeout_s`."""
        try:
            return wait_idle(self.base_url, timeout_s, settle_s)
        except TimeoutError as e:
            raise AssertionError(str(e)) from None


def start_server(*extra: str, env: dict[str, str] | None = None, replicas: int = 1,
                 kv_pool_gib: float = 0.5):
    """Start `genserve serve` on free ports with `replicas` engines; yields a Server, stops it
    afterwards."""
    port, grpc_port, metrics_port = reserve_ports(1, replicas, replicas)
    proc = subprocess.Popen(
        [sys.executable, "-m", "genserve.deploy.cli", "serve", "--port", str(port), "--grpc-port", str(grpc_port),
         "--metrics-port", str(metrics_port), "--kv-pool-gib", str(kv_pool_gib),
         "--replicas", str(replicas), "--ready-timeout-s", str(START_TIMEOUT_S), *extra],
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
        # "not ready after ...": the supervisor goes on waiting, but no more lines may come, and
        # a readline here would block for ever.
        if ("not ready after" in line or proc.poll() is not None or time.monotonic() > deadline
                or not line):
            proc.terminate()            # the supervisor stops its engine, bridge and Envoy (a
            try:                        # SIGKILL would leave them running, Envoy on its ports)
                proc.wait(30)
            except subprocess.TimeoutExpired:
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
    public_grpc = f"127.0.0.1:{grpc_port}" if "--no-envoy" in extra else f"127.0.0.1:{port}"
    yield Server(base, public_grpc, proc, output,
                 engine_targets=[f"127.0.0.1:{grpc_port + i}" for i in range(replicas)],
                 engine_metrics_urls=[f"http://127.0.0.1:{metrics_port + i}/metrics" for i in range(replicas)])
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
