"""No kind of blocking work waits for asyncio's default executor: with every one of its
threads held, a model registers, loads, serves a caller whose key is checked in SQL, and
unloads (backends/workers.py says which pool each kind uses)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

from tests.support.hubs import ADMIN, auth_settings, running_app

# Bound on any wait in this test: a hang guard, never reached when it passes.
GUARD_S = 60.0


def test_registry_loads_auth_and_unloads_never_wait_for_the_default_executor(
    tmp_path: Path, mlflow_template: Path, tiny_embedder_dir: Path
) -> None:
    settings, user_key = auth_settings(tmp_path, mlflow_template)
    user = {"Authorization": f"Bearer {user_key}"}

    async def scenario() -> None:
        async with running_app(settings) as (_app, client):
            loop = asyncio.get_running_loop()
            release = threading.Event()
            # More calls than the default executor has threads on any machine: all held.
            held = [loop.run_in_executor(None, release.wait, GUARD_S) for _ in range(40)]
            try:
                body = {"name": "emb", "kind": "embedder", "source": str(tiny_embedder_dir)}
                steps = [
                    ("POST", "/admin/registry/models", body, ADMIN, 201),
                    ("POST", "/admin/models/emb/versions/1/load", None, ADMIN, 200),
                    ("POST", "/v1/embeddings", {"model": "emb", "input": "hi"}, user, 200),
                    ("POST", "/admin/models/emb/versions/1/unload", None, ADMIN, 200),
                ]
                for method, path, json, headers, status in steps:
                    call = client.request(method, path, json=json, headers=headers)
                    r = await asyncio.wait_for(call, GUARD_S)
                    assert r.status_code == status, (path, r.text)
                assert not any(f.done() for f in held)
            finally:
                release.set()
                await asyncio.gather(*held)

    asyncio.run(scenario())
