"""A warm restore of a real tiny LLM through the manager: parked in the host tier and
brought back by a request, it is the same backend (engine, tokenizer) with the same greedy
tokens, and the load path ran once: the metrics count one cold load and one warm one per
restore."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from backends.base import Backend
from backends.kinds import backend_class
from backends.llm.backend import LLMBackend
from backends.llm.sampling_params import SamplingParams
from backends.runtime_config import config_type
from hub.manager import Device, ModelKey, ModelManager, ModelState
from hub.manager.footprint import Footprint
from hub.manager.lifecycle import BackendLifecycle
from hub.manager.loader import PreparedVersion, VersionLoader
from hub.metrics import HubMetrics
from hub.settings import ManagerSettings
from tests.backends.llm.support import build_model
from tests.support.residency import settled, state

MiB = 2**20
CONFIG = {"kv_cache_bytes": "2MiB", "dtype": "float32"}


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("restore-llm"), "llama")


class FolderLoader(VersionLoader):
    """The real loader with the registry replaced by one folder served as every version;
    counts the loads it runs."""

    def __init__(self, folder: Path) -> None:
        super().__init__(None)  # type: ignore[arg-type]
        self.folder = folder
        self.loads = 0

    def prepare(self, key: ModelKey) -> PreparedVersion:
        view: Any = SimpleNamespace(
            name=key.name, version=key.version, kind="llm", runtime_config=CONFIG, base=None
        )
        return PreparedVersion(
            view, self.folder, backend_class("llm"), config_type("llm").parse(CONFIG)
        )

    def load(
        self, prepared: PreparedVersion, device: str, device_budget: int | None = None
    ) -> Backend:
        self.loads += 1
        return super().load(prepared, device, device_budget)


async def greedy(backend: Backend) -> list[int]:
    assert isinstance(backend, LLMBackend)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    prompt = backend.encode("The harbour town woke slowly")
    return [t async for out in backend.generate(prompt, params) for t in out.token_ids]


def loads(manager: ModelManager, source: str) -> float:
    """hub_model_loads_total{model="llm", outcome="ok", source=...}."""
    return float(manager.metrics.loads.labels("llm", "1", "ok", source)._value.get())


async def test_a_warm_restore_reuses_the_loaded_llm(llama: Path) -> None:
    devices = [Device("cpu", 512 * MiB)]
    loader = FolderLoader(llama)
    manager = ModelManager(
        ManagerSettings(min_residency=0, load_timeout=60),
        devices,
        None,
        HubMetrics(),
        host_cache_budget=512 * MiB,
        lifecycle=BackendLifecycle(loader, Footprint(devices)),
    )
    try:
        async with manager.acquire("llm", 1) as backend:
            first = await greedy(backend)
            engine, tokenizer = backend.engine, backend.tokenizer
        for round_ in range(1, 3):
            assert manager.release_copy("llm", 1, reason="test")
            await settled(manager)
            assert state(manager, "llm") is ModelState.WARM
            async with manager.acquire("llm", 1) as again:
                assert again is backend and again.engine is engine
                assert again.tokenizer is tokenizer
                assert await greedy(again) == first
            assert loader.loads == 1  # restored, never loaded again
            assert loads(manager, "cold") == 1 and loads(manager, "warm") == round_
        [row] = manager.status()
        assert row.warm_load_s is not None and row.cold_load_s is not None
    finally:
        await manager.close()
