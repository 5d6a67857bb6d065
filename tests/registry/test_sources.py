"""Register sources beyond local folders: hf:// (offline from the cache) and MLflow URIs."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from registry.errors import InvalidSourceError
from registry.service import Registry
from registry.sources import sha256_file


def fake_hf_cache(cache: Path, repo: str, folder: Path, revision: str = "a" * 40) -> None:
    """The layout huggingface_hub keeps on disk: refs/main -> snapshots/<commit>/<files>."""
    root = cache / f"models--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(revision)
    shutil.copytree(folder, root / "snapshots" / revision)


def test_hf_source_offline_from_the_local_cache(
    registry: Registry, tiny_embedder_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cache = tmp_path / "hf"
    fake_hf_cache(cache, "acme/tiny-embedder", tiny_embedder_dir)
    registry.fetcher.hf_cache_dir = cache
    view = registry.register("emb", "embedder", "hf://acme/tiny-embedder")
    assert view.source_uri == "hf://acme/tiny-embedder"
    assert view.manifest["model.safetensors"] == sha256_file(
        tiny_embedder_dir / "model.safetensors"
    )


def test_hf_source_not_cached_while_offline_is_a_clear_error(
    registry: Registry, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    registry.fetcher.hf_cache_dir = tmp_path / "empty-cache"
    with pytest.raises(InvalidSourceError, match=r"not reachable.*not in the local cache"):
        registry.register("emb", "embedder", "hf://acme/never-downloaded@main")
    assert registry.list_models() == []


def test_malformed_hf_source(registry: Registry) -> None:
    with pytest.raises(InvalidSourceError, match="hf://org/name"):
        registry.register("emb", "embedder", "hf://a/b/c/d")


def test_register_from_an_mlflow_model_uri(registry: Registry, tiny_embedder_dir: Path) -> None:
    first = registry.register("emb", "embedder", str(tiny_embedder_dir), aliases=["champion"])
    by_number = registry.register("emb-copy", "embedder", "models:/emb/1")
    by_alias = registry.register("emb-copy", "embedder", "models:/emb@champion")
    assert by_number.manifest == by_alias.manifest == first.manifest
    run_uri = first.artifact_uri.split("/artifacts/")[0]  # file:///.../<run id>
    run_id = run_uri.rsplit("/", 1)[1]
    by_run = registry.register("emb-run", "embedder", f"runs:/{run_id}/model")
    assert by_run.manifest == first.manifest


def test_unknown_mlflow_model_is_refused(registry: Registry) -> None:
    with pytest.raises(InvalidSourceError, match="cannot fetch models:/ghost/1"):
        registry.register("emb", "embedder", "models:/ghost/1")
    assert registry.list_models() == []
