"""Fixtures for the bridge tests: a fake gRPC service, the app over ASGI, a live uvicorn bridge."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from bridge.app import create_app
from tests.bridge.fake_generate_service import FakeServer
from tests.bridge.sse import MODEL_NAME
from tests.uvicorn_app import served


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
    async with served(create_app(fake.target, model_name=MODEL_NAME)) as url:
        yield url
