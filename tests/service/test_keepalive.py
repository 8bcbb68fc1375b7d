"""Keepalive between Envoy and an engine: Envoy pings each engine connection every
`keepaliveIntervalSeconds`, and the engine's gRPC server (started with the same interval) accepts
those pings, so a stream that sends nothing for several intervals is not cut by GOAWAY
too_many_pings. Run for real: the chart's Envoy in front of an EngineServer (simulated model)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from genserve.common import keepalive
from genserve.deploy import envoy
from tests.deploy.test_envoy_runtime import start_envoy, stop
from tests.service.harness import running_server

PING_INTERVAL_S = 0.5
SILENT_S = 4 * PING_INTERVAL_S * 1.15 + 0.5   # > 3 intervals even with Envoy's 15 % jitter
SERVICE = "genserve.v1.GenerateService"


async def _watch_silently(engine_port: int, tmp_path, silent_over: asyncio.Event
                          ) -> tuple[list[int], grpc.aio.AioRpcError | None]:
    """Open grpc.health.v1 Watch through Envoy, read the first status, stay silent `SILENT_S`,
    set `silent_over`, and read the next status (the engine's health turning NOT_SERVING).
    Returns the statuses read and the error the stream ended with (None: none)."""
    proxy = start_envoy(tmp_path, bridge_port=engine_port, engine_ports=[engine_port],
                        engine_values={"keepaliveIntervalSeconds": PING_INTERVAL_S})
    statuses: list[int] = []
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{proxy.port}") as channel:
            call = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=SERVICE))
            try:
                statuses.append((await call.read()).status)
                await asyncio.sleep(SILENT_S)
                silent_over.set()
                statuses.append((await asyncio.wait_for(call.read(), 10)).status)
            except grpc.aio.AioRpcError as err:
                return statuses, err
            finally:
                silent_over.set()
        return statuses, None
    finally:
        stop(proxy.process)


async def test_engine_accepts_envoys_pings_on_a_silent_stream(tmp_path):
    silent_over = asyncio.Event()
    async with running_server(keepalive_interval_s=PING_INTERVAL_S) as running:
        task = asyncio.create_task(_watch_silently(running.server.port, tmp_path, silent_over))
        silent = asyncio.create_task(silent_over.wait())
        # The watcher may end before its silence (Envoy missing: a skip; Envoy failing to start):
        # then its outcome is the test's, and the server still stops.
        await asyncio.wait([task, silent], timeout=60, return_when=asyncio.FIRST_COMPLETED)
        silent.cancel()
        running.stop.set()                      # drain: health NOT_SERVING, sent on the Watch
        statuses, err = await asyncio.wait_for(task, 30)
    assert err is None, f"silent stream cut: {err.code().name} {err.details()}"
    assert statuses == [health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING]


def test_server_options_accept_pings_at_the_shared_interval():
    options = dict(keepalive.server_options(30.0))
    assert options["grpc.http2.min_ping_interval_without_data_ms"] == 15_000
    assert options["grpc.keepalive_permit_without_calls"] == 1
    assert dict(keepalive.channel_options(30.0))["grpc.keepalive_time_ms"] == 30_000
    with pytest.raises(ValueError):
        keepalive.server_options(0)


def test_chart_defaults_are_the_shared_interval():
    values = yaml.safe_load((envoy.CHART_DIR / "values.yaml").read_text())["envoy"]["engines"]
    assert values["keepaliveIntervalSeconds"] == keepalive.PING_INTERVAL_S
    assert values["keepaliveTimeoutSeconds"] == keepalive.PING_TIMEOUT_S
