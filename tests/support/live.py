"""The hub app served by a real uvicorn server on a loopback port, in a thread of the test
process: real HTTP (streaming, client disconnects) without starting a subprocess."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI

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
