"""Fixtures for the bridge tests: a fake gRPC service, the app over ASGI, a live uvicorn bridge."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

import httpx
import pytest
import uvicorn

from bridge.app import create_app
from tests.bridge.fake_generate_service import FakeServer
from tests.bridge.sse import MODEL_NAME


@pytest.fixture
async def fake() -> AsyncIterator[FakeServer]:
    server = FakeServer()
    await server.start()
    yield server
    await server.stop()


@pytest.fixture
async def client(fake: FakeServer) -> AsyncIterator[httpx.AsyncClient]:
    """An httpx client talking to the bridge app in-process (lifespan run)."""
    app = create_app(fake.target, model_name=MODEL_NAME)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://bridge", timeout=10) as c:
            yield c


@pytest.fixture
async def live_bridge(fake: FakeServer) -> AsyncIterator[str]:
    """A real uvicorn bridge on a free localhost port (same event loop); yields its base URL."""
    app = create_app(fake.target, model_name=MODEL_NAME)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    for _ in range(500):
        if server.started or task.done():
            break
        await asyncio.sleep(0.01)
    assert server.started, "uvicorn did not start"
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    await asyncio.wait_for(task, 10)
    sock.close()
