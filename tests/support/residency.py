"""Checks on a running manager: budgets hold at every step, waiting until it is idle."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from hub.manager import ModelKey, ModelManager, ModelState


def within_budget(manager: ModelManager) -> None:
    """The ledger and the bytes the backends measurably hold stay within every budget."""
    for device in manager.devices:
        assert manager.ledger.used(device.name) <= device.budget_bytes
        held = sum(
            e.backend.memory_bytes()
            for e in manager._entries.values()
            if e.backend is not None and e.device == device.name
        )
        assert held <= device.budget_bytes, f"{device.name}: backends hold {held} bytes"
    assert manager.host_tier.used_bytes <= manager.host_tier.budget_bytes


@contextlib.asynccontextmanager
async def budget_watch(manager: ModelManager) -> AsyncIterator[list[int]]:
    """Check `within_budget` about every millisecond while the block runs; yields a
    list that counts the checks taken while a load or an eviction was under way, the
    moments the budget is at risk."""
    checks: list[int] = [0]

    async def watch() -> None:
        while True:
            within_budget(manager)
            if _under_way(manager):
                checks[0] += 1
            await asyncio.sleep(0.001)  # ~every step, without starving worker threads

    task = asyncio.create_task(watch())
    try:
        yield checks
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        within_budget(manager)


def _under_way(manager: ModelManager) -> list[asyncio.Task[Any]]:
    """The loads and evictions not finished yet."""
    return [
        t
        for e in manager._entries.values()
        for t in (e.load_task, e.evict_task)
        if t is not None and not t.done()
    ]


async def settled(manager: ModelManager) -> None:
    """Wait until no eviction or load is in progress."""
    for _ in range(10_000):
        busy = _under_way(manager)
        if not busy:
            return
        await asyncio.gather(*busy, return_exceptions=True)
    raise AssertionError("the manager never settled")


def state(manager: ModelManager, name: str, version: int = 1) -> ModelState:
    entry = manager.entry(ModelKey(name, version))
    return entry.state if entry is not None else ModelState.UNLOADED
