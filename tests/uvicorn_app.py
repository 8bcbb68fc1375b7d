"""Serve an ASGI app with a real uvicorn on a free localhost port, in the test's event loop."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator

import uvicorn


@contextlib.asynccontextmanager
async def served(app) -> AsyncIterator[str]:
    """Run `app` (lifespan on) until the block ends; yields its base URL "http://127.0.0.1:PORT"."""
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
    if not server.started:
        task.cancel()
        [outcome] = await asyncio.gather(task, return_exceptions=True)
        sock.close()
        raise AssertionError(f"uvicorn did not start: {outcome!r}")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)
        sock.close()
