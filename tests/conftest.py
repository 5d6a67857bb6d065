"""Root of the test suite: shared fixtures come from plugins (tests/support/fixtures/); each
folder's conftest.py adds its own.

Two modes:

* the full suite (`make test`): every test, with torch, FastAPI, SQLAlchemy and MLflow;
* pure (`make test-pure`, `HUB_PURE_TESTS=1`): only the modules marked `pytest.mark.pure`,
  in a bare virtual environment without torch, FastAPI, SQLAlchemy or Prometheus. It proves
  the pure layers (the manager's planner, the engine's scheduler and block pool, the
  statistics) stand on their own. Other modules are not even imported, so this file and
  every conftest.py on the way to a pure module import nothing heavy at module level.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

PURE = os.environ.get("HUB_PURE_TESTS") == "1"

# Nothing may reach a model hub at test time.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")

if not PURE:
    pytest_plugins = ["tests.support.fixtures.models", "tests.support.fixtures.apps"]

_PURE_MARK = "mark.pure"


def _declares_pure(path: Path) -> bool:
    return _PURE_MARK in path.read_text(encoding="utf-8", errors="replace")


def _holds_pure(folder: Path) -> bool:
    return any(_declares_pure(p) for p in folder.rglob("test_*.py"))


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """In pure mode, skip every test module (and folder) that declares no pure test, so
    their imports never run."""
    if not PURE:
        return None
    if collection_path.is_dir():
        return None if _holds_pure(collection_path) else True
    if collection_path.name.startswith("test_") and collection_path.suffix == ".py":
        return None if _declares_pure(collection_path) else True
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `cuda` need a CUDA GPU: skipped (never failed) where torch sees none."""
    if PURE or not any(item.get_closest_marker("cuda") for item in items):
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("cuda"):
            item.add_marker(skip)
