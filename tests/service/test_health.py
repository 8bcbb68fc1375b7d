"""EngineHealth: Check says NOT_SERVING as soon as the engine has failed, before the server
notices and sets the status (the failure reaches clients first, on their streams)."""

from __future__ import annotations

import asyncio

from grpc_health.v1 import health_pb2

from service.server import EngineHealth

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def test_check_follows_the_engine_between_its_failure_and_the_status_update():
    state = {"alive": True}
    servicer = EngineHealth(lambda: state["alive"])

    async def check() -> int:
        return (await servicer.Check(health_pb2.HealthCheckRequest(service=""), None)).status

    async def scenario() -> list[int]:
        await servicer.set("", SERVING)
        seen = [await check()]
        state["alive"] = False                      # the scheduler thread just died
        seen.append(await check())
        await servicer.set("", NOT_SERVING)         # what Server.fail does once it notices
        seen.append(await check())
        return seen

    assert asyncio.run(scenario()) == [SERVING, NOT_SERVING, NOT_SERVING]
