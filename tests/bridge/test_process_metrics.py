"""The standard `process_*` series: the engine's (`component="engine"`) and the bridge's
(`component="bridge"`) on the bridge's merged /metrics, each family declared once, the values
this process's own, and promtool accepts the result (one engine and several)."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from prometheus_client import generate_latest, start_http_server
from prometheus_client.parser import text_string_to_metric_families

from bridge.metrics import BridgeMetrics
from service.metrics import EngineMetrics
from tests.engine.sim import sim_engine

PROCESS_FAMILIES = ("process_resident_memory_bytes", "process_virtual_memory_bytes",
                    "process_cpu_seconds", "process_open_fds", "process_max_fds", "process_start_time_seconds")


def samples(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


@pytest.fixture
def engine_metrics_urls():
    """Two engines' real /metrics endpoints (EngineMetrics over simulated engines, in this
    process); yields their URLs."""
    servers = []
    for _ in range(2):
        engine, _clock = sim_engine(num_blocks=16)
        httpd, _thread = start_http_server(0, addr="127.0.0.1", registry=EngineMetrics(engine).registry)
        servers.append(httpd)
    yield [f"http://127.0.0.1:{s.server_address[1]}/metrics" for s in servers]
    for httpd in servers:
        httpd.shutdown()
        httpd.server_close()


def test_engine_metrics_carry_the_process_series():
    engine, _ = sim_engine(num_blocks=16)
    got = samples(generate_latest(EngineMetrics(engine).registry).decode())
    me = psutil.Process()
    rss = got[("process_resident_memory_bytes", (("component", "engine"),))]
    assert 0.5 * me.memory_info().rss < rss < 2 * me.memory_info().rss
    start = got[("process_start_time_seconds", (("component", "engine"),))]
    assert abs(start - me.create_time()) < 1.0
    assert got[("process_cpu_seconds_total", (("component", "engine"),))] > 0
    assert got[("process_open_fds", (("component", "engine"),))] >= 3


def test_bridge_alone_exports_its_process_series():
    text = asyncio.run(BridgeMetrics().exposition()).decode()
    got = samples(text)
    assert abs(got[("process_start_time_seconds", (("component", "bridge"),))] - psutil.Process().create_time()) < 1
    assert got[("process_open_fds", (("component", "bridge"),))] == pytest.approx(
        len(os.listdir("/proc/self/fd")), abs=3)


@pytest.mark.parametrize("replicas", [1, 2])
def test_merged_metrics_keep_each_process_apart(engine_metrics_urls, replicas):
    text = asyncio.run(BridgeMetrics(engine_metrics_urls[:replicas]).exposition()).decode()
    got = samples(text)
    engine_labels = [(("component", "engine"),)] if replicas == 1 else \
        [(("component", "engine"), ("replica", str(i))) for i in range(replicas)]
    for family in PROCESS_FAMILIES:
        name = family + ("_total" if family == "process_cpu_seconds" else "")
        assert (name, (("component", "bridge"),)) in got, name
        for labels in engine_labels:
            assert (name, labels) in got, (name, labels)
        # Each family declared once, the bridge's and the engines' samples under it.
        assert text.count(f"# TYPE {name} ") == 1
    # The engine's own series came along unchanged.
    rows = [(("replica", str(i)),) for i in range(replicas)] if replicas > 1 else [()]
    for labels in rows:
        assert got[("genserve_running_rows", labels)] == 0


@pytest.mark.parametrize("replicas", [1, 2])
def test_promtool_accepts_the_merged_process_metrics(engine_metrics_urls, replicas):
    tool = shutil.which("promtool") or str(Path(sys.executable).parent / "promtool")
    if not Path(tool).exists():
        pytest.skip("promtool not found (scripts/bootstrap.sh copies it into .venv/bin when apt-get exists)")
    text = asyncio.run(BridgeMetrics(engine_metrics_urls[:replicas]).exposition()).decode()
    assert 'process_resident_memory_bytes{component="engine"' in text
    check = subprocess.run([tool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
