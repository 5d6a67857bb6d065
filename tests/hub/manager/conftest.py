"""A manager over fake models that really hold memory (see tests.support.fake_models)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:  # imported in the fixture: the planner's pure tests live below this folder
    from hub.manager import ModelManager
    from tests.support.fake_models import FakeLoader

MiB = 2**20


MakeManager = Callable[..., "tuple[ModelManager, FakeLoader]"]


@pytest.fixture
async def make_manager() -> AsyncIterator[MakeManager]:
    from hub.manager import Device, ModelManager
    from hub.metrics import HubMetrics
    from hub.settings import ManagerSettings
    from tests.support.fake_models import FakeLoader

    made: list[ModelManager] = []

    def make(
        models: dict[str, int | dict[str, Any]],
        *,
        budget_mib: int = 100,
        host_mib: int = 0,
        **settings: Any,
    ) -> tuple[ModelManager, FakeLoader]:
        configs = {
            name: ({"bytes": spec * MiB} if isinstance(spec, int) else spec)
            for name, spec in models.items()
        }
        loader = FakeLoader(configs)
        values: dict[str, Any] = {
            "min_residency": 0,
            "load_timeout": 10,
            "idle_check_interval": 0.05,
            "retry_after": 1,
            **settings,
        }
        manager = ModelManager(
            ManagerSettings(**values),
            [Device("cpu", budget_mib * MiB)],
            loader,  # type: ignore[arg-type]
            HubMetrics(),
            host_cache_budget=host_mib * MiB,
        )
        made.append(manager)
        return manager, loader

    yield make
    for manager in made:
        await manager.close()
