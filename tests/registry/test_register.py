"""Registering versions: files land in MLflow, rows in SQL; bad sources leave no trace."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from sqlalchemy import func, select

from registry.errors import ConflictError, IntegrityError, InvalidSourceError, NotFoundError
from registry.schema import ModelVersion, RegisteredModel
from registry.service import Registry
from registry.sources import sha256_file


def counts(registry: Registry) -> tuple[int, int, int]:
    """(SQL models, SQL versions, MLflow registered models)."""
    with registry.db.session() as s:
        models = s.scalar(select(func.count()).select_from(RegisteredModel)) or 0
        versions = s.scalar(select(func.count()).select_from(ModelVersion)) or 0
    return models, versions, len(registry.mlflow.all_aliases())


def test_register_records_manifest_and_mlflow_version(
    registry: Registry, tiny_embedder_dir: Path
) -> None:
    v1 = registry.register("emb", "embedder", str(tiny_embedder_dir), aliases=["production"])
    v2 = registry.register("emb", "embedder", str(tiny_embedder_dir))
    assert (v1.version, v2.version) == (1, 2)
    assert v1.mlflow_model_uri == "models:/emb/1"
    weights = tiny_embedder_dir / "model.safetensors"
    assert v1.manifest["model.safetensors"] == sha256_file(weights)
    assert v1.total_bytes == sum(
        p.stat().st_size for p in tiny_embedder_dir.rglob("*") if p.is_file()
    )
    assert v1.dtype == "float32"
    assert v1.runtime_config["normalize"] is True
    # MLflow's own client sees the version and the alias.
    mv = registry.mlflow.client.get_model_version_by_alias("emb", "production")
    assert int(mv.version) == 1
    model = registry.get_model("emb")
    assert model.default_version() == 1  # production wins over the latest
    [event] = registry.events("emb")
    assert (event.alias, event.action, event.version, event.from_version) == (
        "production", "set", 1, None,
    )  # fmt: skip


def test_latest_version_is_default_without_production(
    registry: Registry, tiny_embedder_dir: Path
) -> None:
    registry.register("emb", "embedder", str(tiny_embedder_dir))
    registry.register("emb", "embedder", str(tiny_embedder_dir))
    model = registry.get_model("emb")
    assert sorted(model.versions) == [1, 2]
    assert model.default_version() == 2


def test_materialise_verifies_and_reuses(registry: Registry, tiny_embedder_dir: Path) -> None:
    view = registry.register("emb", "embedder", str(tiny_embedder_dir))
    path = registry.materialise(view)
    assert sha256_file(path / "model.safetensors") == view.manifest["model.safetensors"]
    assert registry.materialise(view) == path  # second call: already verified
    # A corrupted MLflow artifact is caught by the manifest check, and nothing is cached.
    registry.cache.evict("emb", 1)
    artifact = Path(view.artifact_uri.removeprefix("file://")) / "model.safetensors"
    artifact.write_bytes(b"\0" * artifact.stat().st_size)
    with pytest.raises(IntegrityError, match=r"model\.safetensors"):
        registry.materialise(view)
    assert not registry.cache.path("emb", 1).exists()


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        ("missing", "does not exist"),
        ("empty", "no weights"),
        ("pickle", "pickle"),
        ("no-tokenizer", "no tokenizer"),
    ],
)
def test_bad_sources_are_refused_and_leave_nothing(
    registry: Registry, tiny_embedder_dir: Path, tmp_path: Path, setup: str, message: str
) -> None:
    src = tmp_path / "src"
    if setup != "missing":
        shutil.copytree(tiny_embedder_dir, src)
    if setup == "empty":
        (src / "model.safetensors").unlink()
    if setup == "pickle":
        (src / "model.safetensors").rename(src / "pytorch_model.bin")
    if setup == "no-tokenizer":
        for name in ("tokenizer.json", "vocab.txt"):
            (src / name).unlink(missing_ok=True)
    before = counts(registry)
    with pytest.raises(InvalidSourceError, match=message):
        registry.register("emb", "embedder", str(src))
    assert counts(registry) == before == (0, 0, 0)


def test_kind_mismatch_is_refused(
    registry: Registry, tiny_llm_dir: Path, tiny_reranker_dir: Path
) -> None:
    with pytest.raises(InvalidSourceError, match="looks like a llm"):
        registry.register("x", "embedder", str(tiny_llm_dir))
    with pytest.raises(InvalidSourceError, match="looks like a reranker"):
        registry.register("x", "llm", str(tiny_reranker_dir))
    assert counts(registry) == (0, 0, 0)


def test_a_name_keeps_its_kind(
    registry: Registry, tiny_embedder_dir: Path, tiny_reranker_dir: Path
) -> None:
    registry.register("m", "embedder", str(tiny_embedder_dir))
    with pytest.raises(ConflictError, match="registered as a embedder"):
        registry.register("m", "reranker", str(tiny_reranker_dir))
    assert counts(registry)[1] == 1


def test_unknown_names_list_what_exists(registry: Registry, tiny_embedder_dir: Path) -> None:
    registry.register("emb", "embedder", str(tiny_embedder_dir))
    with pytest.raises(NotFoundError, match=r"known: emb"):
        registry.get_model("nope")
    with pytest.raises(NotFoundError, match=r"versions: 1"):
        registry.get_version("emb", 7)


def test_invalid_names_and_aliases(registry: Registry, tiny_embedder_dir: Path) -> None:
    with pytest.raises(InvalidSourceError, match="invalid model name"):
        registry.register("bad name@x", "embedder", str(tiny_embedder_dir))
    with pytest.raises(InvalidSourceError, match="reserved"):
        registry.register("emb", "embedder", str(tiny_embedder_dir), aliases=["v3"])
    assert counts(registry) == (0, 0, 0)
