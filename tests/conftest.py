"""Shared fixtures: tiny models built once per session, per-test hub settings and apps."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from hub.app import create_app
from hub.settings import HubSettings
from tests.support.hubs import make_mlflow_template, make_settings, running_app

# Nothing may reach a model hub at test time.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny-models")


@pytest.fixture(scope="session")
def tiny_embedder_dir(tiny_root: Path) -> Path:
    from backends.tiny import build_tiny_embedder

    return build_tiny_embedder(tiny_root / "embedder")


@pytest.fixture(scope="session")
def tiny_embedder_v2_dir(tiny_root: Path) -> Path:
    from backends.tiny import build_tiny_embedder

    return build_tiny_embedder(tiny_root / "embedder-v2", seed=1)


@pytest.fixture(scope="session")
def tiny_reranker_dir(tiny_root: Path) -> Path:
    from backends.tiny import build_tiny_reranker

    return build_tiny_reranker(tiny_root / "reranker")


@pytest.fixture(scope="session")
def tiny_llm_dir(tiny_root: Path) -> Path:
    from backends.tiny import build_tiny_llm

    return build_tiny_llm(tiny_root / "llm-llama", "llama")


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    from hub.demo import minilm_dir

    try:
        return minilm_dir()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def mlflow_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_mlflow_template(tmp_path_factory.mktemp("mlflow-template"))


@pytest.fixture
def settings(tmp_path: Path, mlflow_template: Path) -> HubSettings:
    return make_settings(tmp_path / "hub", mlflow_template)


@pytest.fixture
def client(settings: HubSettings) -> Iterator[TestClient]:
    with TestClient(create_app(settings)) as c:
        yield c


@pytest.fixture
async def app_client(settings: HubSettings) -> AsyncIterator[tuple[FastAPI, httpx.AsyncClient]]:
    async with running_app(settings) as pair:
        yield pair
