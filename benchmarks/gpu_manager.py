"""A `ModelManager` over one model folder for `benchmarks/gpu_check.py`: the real manager,
footprint and LLM backend, with the registry replaced by a loader that serves the folder as
version 1 (no database, no MLflow), so a restore is timed through the same path a request
takes."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from benchmarks.gpu_sections import Context
    from hub.manager import ModelManager

GiB = 2**30


class FolderLoader:
    """`VersionLoader`'s blocking steps for one LLM folder served as `name`@1."""

    def __init__(self, ctx: Context, folder: Path, config: dict[str, Any]) -> None:
        self.ctx, self.folder, self.config = ctx, folder, config

    def prepare(self, key: Any) -> Any:
        from backends.llm.backend import LLMBackend
        from backends.runtime_config import LLMConfig
        from hub.manager.loader import PreparedVersion

        view = SimpleNamespace(name=key.name, version=key.version, kind="llm")
        config = LLMConfig.parse(self.config)
        return PreparedVersion(view, self.folder, LLMBackend, config)  # type: ignore[arg-type]

    def load(self, prepared: Any, device: str, device_budget: int | None = None) -> Any:
        from benchmarks.gpu_models import llm_backend

        return llm_backend(self.ctx, prepared.artifact_dir, self.config)


def folder_manager(ctx: Context, folder: Path) -> ModelManager:
    """A manager with one device (16 GiB of it on a GPU) and a host tier that holds the
    model warm; call from a running event loop."""
    from hub.manager import Device, ModelManager
    from hub.manager.footprint import Footprint
    from hub.manager.lifecycle import BackendLifecycle
    from hub.metrics import HubMetrics
    from hub.settings import ManagerSettings

    config = {"kv_cache_bytes": (64 * 2**20) if ctx.small else GiB,
              "dtype": "bfloat16" if ctx.cuda else "float32", **ctx.engine_config}  # fmt: skip
    devices = [Device(ctx.device, 16 * GiB if ctx.cuda else 4 * GiB)]
    loader = FolderLoader(ctx, folder, config)
    lifecycle = BackendLifecycle(loader, Footprint(devices))  # type: ignore[arg-type]
    return ModelManager(ManagerSettings(min_residency=0), devices, None, HubMetrics(),
                        host_cache_budget=8 * GiB, lifecycle=lifecycle)  # fmt: skip
