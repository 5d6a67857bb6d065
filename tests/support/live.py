"""Real HTTP on a loopback port without starting a subprocess: the hub app served by uvicorn
in a thread of the test process (`live_hub`), or any ASGI app served in the test's own event
loop (`serving`: a peer replica stand-in, say)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Iterator

import uvicorn
from fastapi import FastAPI
from starlette.types import ASGIApp

from benchmarks.launch.process import free_port
from hub.app import create_app
from hub.settings import HubSettings


@contextlib.contextmanager
def live_hub(settings: HubSettings, timeout: float = 60) -> Iterator[tuple[str, FastAPI]]:
    """Serve a fresh app for `settings`; yield (base URL, app) once it is ready."""
    app = create_app(settings)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="live-hub", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the live hub did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        server.should_exit = True
        thread.join(timeout)


@contextlib.asynccontextmanager
async def serving(app: ASGIApp) -> AsyncIterator[str]:
    """Serve `app` in the running event loop; yield its base URL once it listens."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    task = asyncio.create_task(server.serve())
    while not server.started:  # noqa: ASYNC110  (uvicorn offers a flag, not an event)
        await asyncio.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task
