"""A version's runtime config is checked at every edge: the registration route (400 naming
the key), the CLI (non-zero exit naming the key), the config file's `models:` (the hub
refuses to start) and `Registry.register`; a valid config is stored exactly as given, and
the typed config reaches the backend."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from backends.runtime_config import parse_runtime_config
from hub.cli import app
from hub.settings import SettingsError, load_settings
from registry.cache import ArtifactCache
from registry.db import Database, upgrade
from registry.errors import InvalidConfigError
from registry.mlflow_store import MlflowStore
from registry.service import Registry
from tests.support.hubs import make_settings

runner = CliRunner()

# (kind, config, the key the answer must name)
BAD: list[tuple[str, dict[str, Any], str]] = [
    ("embedder", {"max_batch_sizee": 64}, "max_batch_sizee"),
    ("embedder", {"max_batch_size": -3}, "max_batch_size"),
    ("embedder", {"matryoshka_dims": [16, "eight"]}, "matryoshka_dims.1"),
    ("reranker", {"max_documentz": 10}, "max_documentz"),
    ("reranker", {"max_documents": "many"}, "max_documents"),
    ("reranker", {"keep_alive": "soon"}, "keep_alive"),
    ("llm", {"max_num_seq": 8}, "max_num_seq"),
    ("llm", {"kv_cache_bytes": "lots"}, "kv_cache_bytes"),
    ("llm", {"kv_cache_fraction": 1.5}, "kv_cache_fraction"),
    ("llm", {"max_num_seqs": 64, "max_num_batched_tokens": 16}, "max_num_batched_tokens"),
    # Keys of another kind are unknown here: an embedder has no KV cache.
    ("embedder", {"kv_cache_bytes": "64MiB"}, "kv_cache_bytes"),
]
BAD_IDS = [f"{kind}-{key}" for kind, _, key in BAD]

# The documented examples and tables of docs/engine.md and docs/encoders.md (every key of
# each kind at least once across these).
VALID: dict[str, dict[str, Any]] = {
    "embedder": {"max_batch_tokens": 16384, "max_batch_size": 64, "batch_wait_ms": 2,
                 "max_queue": 4096, "unpadded": True, "batch_overhead_tokens": 32,
                 "forward_workers": 2, "worker_threads": 1, "max_seq_length": 32,
                 "matryoshka_dims": [16, 8], "keep_alive": "10m", "pin": False,
                 "device": "cpu", "dtype": "float32"},
    "reranker": {"max_documents": 1000, "max_batch_size": 8, "batch_wait_ms": 0.5,
                 "unpadded": False, "keep_alive": -1},
    "llm": {"kv_cache_bytes": "64MiB", "max_num_seqs": 32, "block_size": 16,
            "max_num_batched_tokens": 512, "max_model_len": 64, "enable_prefix_caching": True,
            "max_n": 2, "max_tokens_limit": 32, "default_max_tokens": 16, "max_logprobs": 5,
            "max_waiting": 100, "priority_aging_steps": 64, "dtype": "float32",
            "keep_alive": "1h"},
}  # fmt: skip


@pytest.fixture(scope="module")
def sources(tiny_embedder_dir: Path, tiny_reranker_dir: Path, tiny_llm_dir: Path) -> dict:
    return {"embedder": tiny_embedder_dir, "reranker": tiny_reranker_dir, "llm": tiny_llm_dir}


def post(client: TestClient, name: str, kind: str, source: Path, config: Any) -> Any:
    body = {"name": name, "kind": kind, "source": str(source), "config": config}
    return client.post("/admin/registry/models", json=body)


# ---- HTTP ---------------------------------------------------------------------------------
@pytest.mark.parametrize(("kind", "config", "key"), BAD, ids=BAD_IDS)
def test_a_bad_key_or_value_is_a_400_naming_the_key(
    client: TestClient, sources: dict, kind: str, config: dict[str, Any], key: str
) -> None:
    r = post(client, "m", kind, sources[kind], config)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == f"config.{key}"
    assert error["code"] == "invalid_runtime_config"
    assert f"config.{key}" in error["message"]
    # Nothing was written: the model does not exist.
    assert client.get("/admin/registry/models/m/versions").status_code == 404


@pytest.mark.parametrize("kind", sorted(VALID))
def test_a_valid_config_is_accepted_and_stored_unchanged(
    client: TestClient, sources: dict, kind: str
) -> None:
    r = post(client, "m", kind, sources[kind], VALID[kind])
    assert r.status_code == 201, r.text
    (version,) = client.get("/admin/registry/models/m/versions").json()
    stored = version["runtime_config"]
    # As given (sizes and durations stay strings), beside defaults read from the files.
    assert {k: stored[k] for k in VALID[kind]} == VALID[kind]
    assert set(stored) - set(VALID[kind]) <= {"normalize", "context_length"}


def test_the_typed_config_reaches_the_reranker(client: TestClient, tiny_reranker_dir: Path) -> None:
    assert post(client, "rr", "reranker", tiny_reranker_dir, {"max_documents": 3}).status_code
    docs = ["gulls argue", "terns dive", "a quiet harbour", "the fish market"]
    r = client.post("/v1/rerank", json={"model": "rr", "query": "birds", "documents": docs})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "documents"
    assert "max_documents" in r.json()["error"]["message"]
    r = client.post("/v1/rerank", json={"model": "rr", "query": "birds", "documents": docs[:3]})
    assert r.status_code == 200, r.text
    assert len(r.json()["results"]) == 3


def test_the_typed_config_reaches_the_embedder(client: TestClient, tiny_embedder_dir: Path) -> None:
    config = {"matryoshka_dims": [8], "max_seq_length": 6}
    assert post(client, "emb", "embedder", tiny_embedder_dir, config).status_code == 201
    long = " ".join(["word"] * 40)
    r = client.post("/v1/embeddings", json={"model": "emb", "input": long, "dimensions": 8})
    assert r.status_code == 200, r.text
    assert len(r.json()["data"][0]["embedding"]) == 8
    assert r.json()["usage"]["prompt_tokens"] == 6  # truncated at the configured length
    r = client.post("/v1/embeddings", json={"model": "emb", "input": "hi", "dimensions": 4})
    assert r.status_code == 400, r.text


# ---- CLI ----------------------------------------------------------------------------------
@pytest.fixture
def cli_config(tmp_path: Path, mlflow_template: Path) -> Path:
    shutil.copy(mlflow_template, tmp_path / "mlflow.db")
    path = tmp_path / "hub.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "database_url": f"sqlite:///{tmp_path / 'hub.db'}",
                "mlflow_tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}",
                "cache_dir": str(tmp_path / "cache"),
            }
        )
    )
    return path


def cli_register(config: Path, kind: str, source: Path, runtime: Any) -> Any:
    args = ["register", "--name", "m", "--kind", kind, "--source", str(source),
            "--runtime-config", json.dumps(runtime), "--config", str(config)]  # fmt: skip
    return runner.invoke(app, args)


@pytest.mark.parametrize(("kind", "config", "key"), BAD, ids=BAD_IDS)
def test_the_cli_refuses_a_bad_key_naming_it(
    cli_config: Path, sources: dict, kind: str, config: dict[str, Any], key: str
) -> None:
    result = cli_register(cli_config, kind, sources[kind], config)
    assert result.exit_code != 0
    assert key in result.output
    assert "invalid runtime config" in result.output
    assert (
        "is not registered"
        in runner.invoke(app, ["versions", "m", "--config", str(cli_config)]).output
    )


def test_the_cli_refuses_a_config_that_is_not_an_object(cli_config: Path, sources: dict) -> None:
    result = cli_register(cli_config, "embedder", sources["embedder"], [1, 2])
    assert result.exit_code == 2
    assert "JSON object" in result.output


@pytest.mark.parametrize("kind", sorted(VALID))
def test_the_cli_accepts_a_valid_config(cli_config: Path, sources: dict, kind: str) -> None:
    result = cli_register(cli_config, kind, sources[kind], VALID[kind])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output.strip().splitlines()[-1]) == {"name": "m", "version": 1}


# ---- the config file ----------------------------------------------------------------------
def write_models(path: Path, models: list[dict[str, Any]]) -> Path:
    path.write_text(yaml.safe_dump({"models": models}))
    return path


def test_config_file_models_with_a_bad_key_refuse_to_start(tmp_path: Path) -> None:
    path = write_models(tmp_path / "hub.yaml", [
        {"name": "minilm", "kind": "embedder", "source": "builtin:minilm",
         "config": {"max_batch_size": 32}},
        {"name": "rr", "kind": "reranker", "source": "builtin:tiny-reranker",
         "config": {"max_documentz": 10}},
        {"name": "chat", "kind": "llm", "source": "builtin:tiny-llm",
         "config": {"kv_cache_bytes": "a lot"}},
    ])  # fmt: skip
    with pytest.raises(SettingsError) as e:
        load_settings(path)
    message = str(e.value)
    assert "models.1.config" in message and "'rr'" in message and "max_documentz" in message
    assert "models.2.config" in message and "'chat'" in message and "kv_cache_bytes" in message
    assert "models.0" not in message
    result = runner.invoke(app, ["serve", "--config", str(path)])
    assert result.exit_code == 2
    assert "max_documentz" in result.output


def test_config_file_models_with_valid_configs_load(tmp_path: Path) -> None:
    models = [{"name": kind, "kind": kind, "source": "x", "config": config}
              for kind, config in VALID.items()]  # fmt: skip
    settings = load_settings(write_models(tmp_path / "hub.yaml", models))
    assert [spec.config for spec in settings.models] == list(VALID.values())


# ---- the registry itself ------------------------------------------------------------------
def test_registry_register_checks_the_merged_config(
    tmp_path: Path, mlflow_template: Path, tiny_embedder_dir: Path
) -> None:
    settings = make_settings(tmp_path / "hub", mlflow_template)
    upgrade(settings.database_url)
    mlflow = MlflowStore(settings.mlflow_tracking_uri)
    registry = Registry(
        Database(settings.database_url),
        mlflow,
        ArtifactCache(settings.cache_dir, mlflow),
        check_config=parse_runtime_config,
    )
    with pytest.raises(InvalidConfigError, match="max_batch_sizee") as e:
        registry.register("emb", "embedder", str(tiny_embedder_dir), config={"max_batch_sizee": 1})
    assert e.value.key == "max_batch_sizee"
    assert registry.snapshot().models == {}
    view = registry.register("emb", "embedder", str(tiny_embedder_dir), config={"pin": True})
    # The stored mapping: defaults read from the files, the caller's keys as given.
    assert view.runtime_config["pin"] is True
    assert isinstance(view.runtime_config["normalize"], bool)
    parse_runtime_config("embedder", view.runtime_config)  # what is stored checks too


def test_a_bad_config_stored_before_checks_fails_its_load_naming_the_key(
    tmp_path: Path, mlflow_template: Path, tiny_reranker_dir: Path
) -> None:
    from backends.errors import LoadError
    from hub.manager import ModelKey, VersionLoader

    settings = make_settings(tmp_path / "hub", mlflow_template)
    upgrade(settings.database_url)
    mlflow = MlflowStore(settings.mlflow_tracking_uri)
    # A registry without the check stands in for a row written by an older release.
    registry = Registry(
        Database(settings.database_url), mlflow, ArtifactCache(settings.cache_dir, mlflow)
    )
    registry.register("rr", "reranker", str(tiny_reranker_dir), config={"max_documents": "many"})
    with pytest.raises(LoadError, match=r"rr v1: invalid runtime config: max_documents"):
        VersionLoader(registry).prepare(ModelKey("rr", 1))
