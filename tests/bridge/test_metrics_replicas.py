"""The bridge's /metrics with several engines: each engine's samples under a `replica` label, each
metric family once, an unreachable engine left out and counted, and promtool accepts the result."""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import shutil
import socket
import ssl
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from bridge.metrics import BridgeMetrics


def engine_exposition(rows: int, finished: int, ttfts: list[float]) -> bytes:
    """A small exposition shaped like an engine's: a gauge, a labelled counter, a histogram."""
    registry = CollectorRegistry()
    Gauge("genserve_running_rows", "Rows in the running batch.", registry=registry).set(rows)
    Counter("genserve_requests_finished", "Finished requests.", ["reason"],
            registry=registry).labels("length").inc(finished)
    ttft = Histogram("genserve_ttft_seconds", "Time to first token.", buckets=(0.1, 1.0), registry=registry)
    for value in ttfts:
        ttft.observe(value)
    return generate_latest(registry)


class _Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        body = self.server.body() if callable(self.server.body) else self.server.body
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@contextlib.contextmanager
def serve_expositions(*bodies: bytes | Callable[[], bytes]) -> Iterator[list[str]]:
    """Each body on its own HTTP metrics endpoint (a callable is called per request, e.g. a live
    registry's `generate_latest`) until the block ends; yields their URLs, in order."""
    servers = []
    try:
        for body in bodies:
            server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
            server.body = body
            threading.Thread(target=server.serve_forever, daemon=True).start()
            servers.append(server)
        yield [f"http://127.0.0.1:{s.server_address[1]}/metrics" for s in servers]
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()


@pytest.fixture
def engines():
    """Two metrics endpoints with different values; yields their URLs."""
    with serve_expositions(engine_exposition(3, 5, [0.05, 0.5]), engine_exposition(7, 2, [2.0])) as urls:
        yield urls


def samples(text: str) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


def test_each_engine_gets_a_replica_label(engines):
    text = asyncio.run(BridgeMetrics(engines).exposition()).decode()
    got = samples(text)
    assert got["genserve_running_rows{replica=0}"] == 3
    assert got["genserve_running_rows{replica=1}"] == 7
    assert got["genserve_requests_finished_total{reason=length,replica=0}"] == 5
    assert got["genserve_requests_finished_total{reason=length,replica=1}"] == 2
    assert got["genserve_ttft_seconds_bucket{le=0.1,replica=0}"] == 1
    assert got["genserve_ttft_seconds_count{replica=0}"] == 2
    assert got["genserve_ttft_seconds_count{replica=1}"] == 1
    assert got["genserve_bridge_engine_scrape_errors_total{}"] == 0
    # Each family is declared once, however many engines report it.
    assert text.count("# TYPE genserve_running_rows gauge") == 1
    assert text.count("# TYPE genserve_ttft_seconds histogram") == 1


def test_one_engine_is_passed_through_unlabelled(engines):
    text = asyncio.run(BridgeMetrics(engines[0]).exposition()).decode()
    assert samples(text)["genserve_running_rows{}"] == 3
    assert "replica" not in text


def test_scrapes_reuse_one_tls_context(engines, monkeypatch):
    """Each new TLS context loads the CA bundle on the bridge's event loop (tens of ms that every
    open stream waits on); the console reads /metrics every 2 s, so scrapes must not make one."""
    metrics = BridgeMetrics(engines)
    made = []
    real = ssl.create_default_context
    monkeypatch.setattr(ssl, "create_default_context", lambda *a, **k: made.append(1) or real(*a, **k))
    for _ in range(3):
        assert samples(asyncio.run(metrics.exposition()).decode())["genserve_running_rows{replica=0}"] == 3
    assert made == []


def unreachable_url() -> str:
    """A metrics URL on a localhost port nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}/metrics"


def test_an_unreachable_engine_is_left_out_and_counted(engines):
    dead = unreachable_url()
    got = samples(asyncio.run(BridgeMetrics([engines[0], dead, engines[1]]).exposition()).decode())
    assert got["genserve_running_rows{replica=0}"] == 3
    assert got["genserve_running_rows{replica=2}"] == 7
    assert not any("replica=1" in key for key in got)
    assert got["genserve_bridge_engine_scrape_errors_total{}"] == 1


def test_promtool_accepts_the_merged_exposition(engines):
    tool = shutil.which("promtool") or str(Path(sys.executable).parent / "promtool")
    if not Path(tool).exists():
        pytest.skip("promtool not found (scripts/bootstrap.sh copies it into .venv/bin when apt-get exists)")
    text = asyncio.run(BridgeMetrics(engines).exposition()).decode()
    check = subprocess.run([tool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
