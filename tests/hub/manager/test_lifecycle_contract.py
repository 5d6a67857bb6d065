"""The manager over a fake `Lifecycle` (no torch, no registry): it decides, the lifecycle
does. One load serves every waiter; a model with requests in flight is never evicted, and
its memory is handed to the next model only once its last request ends."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from hub.errors import Unavailable
from hub.manager import Device, ModelKey, ModelManager, ModelState
from hub.metrics import HubMetrics
from hub.settings import ManagerSettings

MiB = 2**20


@dataclass
class Handle:
    """What the fake lifecycle hands out as a backend."""

    key: ModelKey
    nbytes: int
    where: str | None = None

    def offload_bytes(self) -> int:
        return self.nbytes

    def worker_pids(self) -> list[int]:
        return []

    async def aclose(self) -> None:
        pass


@dataclass
class FakeLifecycle:
    """Models by name and size; `gate` holds every load until set; records each step."""

    sizes: Mapping[str, int]
    gate: threading.Event = field(default_factory=threading.Event)
    calls: list[tuple[str, str]] = field(default_factory=list)

    def prepare(self, key: ModelKey) -> Any:
        view = SimpleNamespace(kind="embedder", runtime_config={}, name=key.name)
        return SimpleNamespace(view=view, key=key, config={}, base=None)

    def predict(self, prepared: Any, budgets: Mapping[str, int]) -> dict[str, int]:
        return dict.fromkeys(budgets, self.sizes[prepared.key.name])

    def load(self, prepared: Any, device: str, budget: int) -> tuple[Handle, int]:
        assert self.gate.wait(10), "the test never opened the gate"
        self.calls.append(("load", prepared.key.name))
        nbytes = self.sizes[prepared.key.name]
        return Handle(prepared.key, nbytes, device), nbytes

    def restore(self, backend: Handle, device: str) -> int:
        self.calls.append(("restore", backend.key.name))
        backend.where = device
        return backend.nbytes

    def park(self, backend: Handle, device: str) -> None:
        self.calls.append(("park", backend.key.name))
        backend.where = "host"

    def unload(self, backend: Handle, device: str | None, measured: int) -> None:
        self.calls.append(("unload", backend.key.name))
        backend.where = None


@pytest.fixture
async def fake(request: pytest.FixtureRequest) -> AsyncIterator[tuple[ModelManager, FakeLifecycle]]:
    """Two 60 MiB models, a 100 MiB device, no host tier; `load_timeout` by indirect param."""
    lifecycle = FakeLifecycle({"a": 60 * MiB, "b": 60 * MiB})
    timeout = getattr(request, "param", 5.0)
    settings = ManagerSettings(min_residency=0, load_timeout=timeout, retry_after=1, keep_alive=-1)
    manager = ModelManager(
        settings, [Device("cpu", 100 * MiB)], None, HubMetrics(), lifecycle=lifecycle
    )
    yield manager, lifecycle
    await manager.close()


async def test_one_load_serves_every_waiter(fake: tuple[ModelManager, FakeLifecycle]) -> None:
    manager, lifecycle = fake

    async def use() -> Handle:
        async with manager.acquire("a", 1) as backend:
            return backend  # type: ignore[return-value]

    users = [asyncio.create_task(use()) for _ in range(50)]
    for _ in range(200):
        if manager.status() and manager.status()[0].waiting == 50:
            break
        await asyncio.sleep(0.01)
    [row] = manager.status()
    assert row.state == "loading" and row.waiting == 50  # all joined the one load
    lifecycle.gate.set()
    handles = await asyncio.gather(*users)
    assert len({id(h) for h in handles}) == 1 and handles[0].where == "cpu"
    assert lifecycle.calls == [("load", "a")]
    assert manager.ledger.used("cpu") == 60 * MiB


async def test_a_model_in_flight_is_never_evicted(
    fake: tuple[ModelManager, FakeLifecycle],
) -> None:
    manager, lifecycle = fake
    lifecycle.gate.set()
    release = asyncio.Event()
    holding = asyncio.Event()

    async def hold_a() -> None:
        async with manager.acquire("a", 1):
            holding.set()
            await release.wait()

    holder = asyncio.create_task(hold_a())
    await holding.wait()
    waiter = asyncio.create_task(manager.load("b", 1))
    for _ in range(20):  # plenty of pump rounds while a is in flight
        await asyncio.sleep(0.01)
        assert manager.entry(ModelKey("a", 1)).state is ModelState.LOADED  # type: ignore[union-attr]
    assert not waiter.done() and lifecycle.calls == [("load", "a")]
    # The request ends: only then does a leave (unloaded: no host tier) and b load.
    release.set()
    await holder
    assert (await waiter).state == "loaded"
    assert lifecycle.calls == [("load", "a"), ("unload", "a"), ("load", "b")]
    assert manager.ledger.charges("cpu") == {ModelKey("b", 1): 60 * MiB}


@pytest.mark.parametrize("fake", [0.2], indirect=True)
async def test_while_in_flight_a_waiter_times_out_naming_the_holder(
    fake: tuple[ModelManager, FakeLifecycle],
) -> None:
    manager, lifecycle = fake
    lifecycle.gate.set()
    async with manager.acquire("a", 1):
        with pytest.raises(Unavailable) as e:
            await manager.load("b", 1)
    assert e.value.code == "load_timeout"
    assert "a@1 (60.0 MiB, 1 request in flight)" in e.value.message
    assert ("unload", "a") not in lifecycle.calls


def test_the_manager_itself_imports_no_torch() -> None:
    # Torch comes with real backends (BackendLifecycle), never with the manager's decisions.
    code = "import sys, hub.manager.manager; print('torch' in sys.modules)"
    root = Path(__file__).resolve().parents[3]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
