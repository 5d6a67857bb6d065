"""The promotion workflow through the API: gate, staging before production, rollback, audit
log, hot swap of what is served, and bad input that moves nothing."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient
from safetensors.torch import load_file, save_file

from tests.hub.api.test_embeddings import register


def served_version(client: TestClient, model: str = "emb") -> str:
    r = client.post("/v1/embeddings", json={"model": model, "input": "which version?"})
    assert r.status_code == 200, r.text
    return r.headers["X-Hub-Model-Version"]


def promote(client: TestClient, version: int, to: str, reason: str = "", model: str = "emb"):
    return client.post(
        f"/admin/registry/models/{model}/versions/{version}/promote",
        json={"to": to, "reason": reason},
    )


def corrupt_copy(source: Path, out: Path) -> Path:
    """A copy of `source` whose float weights are NaN: it loads, but its outputs are garbage."""
    import shutil

    shutil.copytree(source, out)
    tensors = load_file(out / "model.safetensors")
    tensors = {k: v.fill_(float("nan")) if v.is_floating_point() else v for k, v in tensors.items()}
    save_file(tensors, out / "model.safetensors")
    return out


@pytest.fixture
def corrupt_embedder_dir(tiny_embedder_dir: Path, tmp_path: Path) -> Path:
    return corrupt_copy(tiny_embedder_dir, tmp_path / "corrupt")


def test_staging_then_production_then_rollback(
    client: TestClient, tiny_embedder_dir: Path, tiny_embedder_v2_dir: Path
) -> None:
    register(client, "emb", "embedder", tiny_embedder_dir)
    register(client, "emb", "embedder", tiny_embedder_v2_dir)
    assert promote(client, 1, "staging", "first candidate").status_code == 200
    r = promote(client, 1, "production", "ship it")
    assert r.status_code == 200, r.text
    assert r.json()["validation"]["passed"] is True
    assert served_version(client) == "1"

    # Production requires staging first.
    r = promote(client, 2, "production")
    assert r.status_code == 409 and "has not passed staging" in r.json()["error"]["message"]
    assert served_version(client) == "1"

    assert promote(client, 2, "staging").status_code == 200
    assert served_version(client, "emb@staging") == "2"
    r = promote(client, 2, "production", "v2 is better")
    assert r.status_code == 200 and r.json()["from_version"] == 1
    assert served_version(client) == "2"  # the hub's own move is followed at once

    r = client.post("/admin/registry/models/emb/rollback", json={"reason": "v2 regressed"})
    assert r.status_code == 200, r.text
    assert (r.json()["version"], r.json()["from_version"]) == (1, 2)
    assert served_version(client) == "1"

    events = client.get("/admin/registry/events", params={"model": "emb"}).json()
    story = [(e["alias"], e["action"], e["from_version"], e["version"]) for e in reversed(events)]
    assert story == [
        ("staging", "promote", None, 1),
        ("production", "promote", None, 1),
        ("staging", "promote", 1, 2),
        ("production", "promote", 1, 2),
        ("production", "rollback", 2, 1),
    ]
    assert events[0]["reason"] == "v2 regressed"
    gated = [e for e in events if e["action"] == "promote"]
    assert all(e["validation"]["passed"] for e in gated)
    versions = client.get("/admin/registry/models/emb/versions").json()
    assert [(v["version"], v["status"], v["aliases"]) for v in versions] == [
        (1, "validated", ["production"]),
        (2, "validated", ["staging"]),
    ]

    # MLflow's own client sees the same aliases as the hub's API.
    from mlflow import MlflowClient

    uri = client.app.state.hub.settings.mlflow_tracking_uri  # type: ignore[attr-defined]
    mlflow_aliases = MlflowClient(tracking_uri=uri, registry_uri=uri).get_registered_model("emb")
    assert {a: int(v) for a, v in mlflow_aliases.aliases.items()} == {"production": 1, "staging": 2}
    assert client.get("/v1/models").json()["data"][0]["aliases"] == {"production": 1, "staging": 2}


def test_corrupt_weights_fail_the_gate_and_production_is_unchanged(
    client: TestClient, tiny_embedder_dir: Path, corrupt_embedder_dir: Path
) -> None:
    register(client, "emb", "embedder", tiny_embedder_dir)
    register(client, "emb", "embedder", corrupt_embedder_dir)
    promote(client, 1, "staging")
    promote(client, 1, "production")
    r = promote(client, 2, "staging", "try the new weights")
    assert r.status_code == 422
    message = r.json()["error"]["message"]
    assert "failed its validation gate" in message and "NaN or inf" in message
    aliases = client.get("/v1/models").json()["data"][0]["aliases"]
    assert aliases == {"production": 1, "staging": 1}
    assert served_version(client) == "1"
    versions = {v["version"]: v for v in client.get("/admin/registry/models/emb/versions").json()}
    assert versions[2]["status"] == "failed"
    failed = {c["name"]: c for c in versions[2]["validation"]["checks"]}
    assert failed["finite"]["passed"] is False and failed["load"]["passed"] is True
    [rejected] = [
        e for e in client.get("/admin/registry/events").json() if e["action"] == "rejected"
    ]
    assert (rejected["alias"], rejected["version"], rejected["from_version"]) == ("staging", 2, 1)
    # A rejected attempt is no step in production's history: rollback still needs two versions.
    r = client.post("/admin/registry/models/emb/rollback")
    assert r.status_code == 409 and "no earlier production version" in r.json()["error"]["message"]


def test_eval_set_gates_the_promotion(client: TestClient, tiny_embedder_dir: Path) -> None:
    passing = {"cases": [{"text": "a cat", "similar_to": "a cat", "min_cosine": 0.99}]}
    failing = {"cases": [{"text": "a cat", "dissimilar_to": "a cat", "max_cosine": 0.5}]}
    register(client, "emb", "embedder", tiny_embedder_dir, eval_set=passing)
    register(client, "emb", "embedder", tiny_embedder_dir, eval_set=failing)
    r = promote(client, 1, "staging")
    assert r.status_code == 200
    checks = {c["name"]: c for c in r.json()["validation"]["checks"]}
    assert checks["eval_set"]["passed"] and "1/1 cases passed" in checks["eval_set"]["detail"]
    r = promote(client, 2, "staging")
    assert r.status_code == 422 and "0/1 cases passed" in r.json()["error"]["message"]


def test_bad_promotions_move_nothing(client: TestClient, tiny_embedder_dir: Path) -> None:
    register(client, "emb", "embedder", tiny_embedder_dir)
    r = promote(client, 1, "prod")
    assert r.status_code == 400 and "unknown stage 'prod'" in r.json()["error"]["message"]
    r = promote(client, 7, "staging")
    assert r.status_code == 404 and "no version 7" in r.json()["error"]["message"]
    r = promote(client, 1, "staging", model="ghost")
    assert r.status_code == 404
    r = client.put("/admin/registry/models/emb/aliases/production", json={"version": 1})
    assert r.status_code == 400 and "only through promote" in r.json()["error"]["message"]
    # A version past what the database stores is the caller's mistake, not a server error.
    r = client.put("/admin/registry/models/emb/aliases/canary", json={"version": 2**63})
    assert r.status_code == 400 and r.json()["error"]["param"] == "version", r.text
    r = promote(client, 2**63, "staging")
    assert r.status_code == 400 and r.json()["error"]["param"] == "path.version", r.text
    bad_eval = {"cases": [{"text": "x"}]}
    r = client.post(
        "/admin/registry/models",
        json={"name": "emb", "kind": "embedder", "source": str(tiny_embedder_dir),
              "eval_set": bad_eval},
    )  # fmt: skip
    assert r.status_code == 400 and "eval_set.cases[0]" in r.json()["error"]["message"]
    assert client.get("/admin/registry/events").json() == []
    assert client.get("/v1/models").json()["data"][0]["aliases"] == {}


def test_free_form_alias(client: TestClient, tiny_embedder_dir: Path) -> None:
    register(client, "emb", "embedder", tiny_embedder_dir)
    register(client, "emb", "embedder", tiny_embedder_dir)
    r = client.put("/admin/registry/models/emb/aliases/canary", json={"version": 2})
    assert r.status_code == 200 and r.json()["version"] == 2
    assert served_version(client, "emb@canary") == "2"
    assert client.delete("/admin/registry/models/emb/aliases/canary").status_code == 200
    assert (
        client.post("/v1/embeddings", json={"model": "emb@canary", "input": "x"}).status_code == 404
    )


def test_alias_moved_in_mlflow_is_followed_within_a_poll(
    client: TestClient, tiny_embedder_dir: Path, tiny_embedder_v2_dir: Path
) -> None:
    """An alias moved with MLflow's own client, outside the hub: the hub serves the new version
    within one poll interval and the audit log records the move as drift."""
    hub = client.app.state.hub  # type: ignore[attr-defined]
    register(client, "emb", "embedder", tiny_embedder_dir)
    register(client, "emb", "embedder", tiny_embedder_v2_dir)
    promote(client, 1, "staging")
    promote(client, 1, "production")
    first = np.array(
        client.post("/v1/embeddings", json={"model": "emb", "input": "x"}).json()["data"][0][
            "embedding"
        ]
    )
    hub.registry.mlflow.client.set_registered_model_alias("emb", "production", "2")
    # Counted in reconciler passes, not seconds: the pass running at the moment of the move
    # may have read the old state; the next one must serve the new version.
    rounds_at_move = hub.reconciler.rounds
    while served_version(client) != "2":
        assert hub.reconciler.rounds - rounds_at_move <= 2, "not followed within one poll"
        time.sleep(0.05)
    second = np.array(
        client.post("/v1/embeddings", json={"model": "emb", "input": "x"}).json()["data"][0][
            "embedding"
        ]
    )
    assert not np.allclose(first, second)  # really another model's output
    # The pass that notices the drift records it; if the move landed between that pass's
    # drift check and its catalog refresh, the new version is served first and the next pass
    # records the event.
    while True:
        latest = client.get("/admin/registry/events").json()[0]
        if (latest["action"], latest["actor"], latest["version"]) == ("sync", "reconciler", 2):
            break
        assert hub.reconciler.rounds - rounds_at_move <= 3, f"drift never recorded: {latest}"
        time.sleep(0.05)


def test_an_llm_with_corrupt_weights_fails_its_gate(
    client: TestClient, tiny_llm_dir: Path, tmp_path: Path
) -> None:
    corrupt = corrupt_copy(tiny_llm_dir, tmp_path / "corrupt-llm")
    config = {"kv_cache_bytes": "4MiB"}
    register(client, "chat", "llm", tiny_llm_dir, config=config)
    register(client, "chat", "llm", corrupt, config=config)
    ok = promote(client, 1, "staging", model="chat")
    assert ok.status_code == 200, ok.text
    checks = {c["name"]: c["passed"] for c in ok.json()["validation"]["checks"]}
    assert checks == {"load": True, "generates": True, "finite": True}
    r = promote(client, 2, "staging", model="chat")
    assert r.status_code == 422 and "non-finite log-probabilities" in r.json()["error"]["message"]
    assert client.get("/v1/models").json()["data"][0]["aliases"] == {"staging": 1}


def test_a_reranker_is_gated_by_its_scores_and_its_eval_set(
    client: TestClient, tiny_reranker_dir: Path, tmp_path: Path
) -> None:
    corrupt = corrupt_copy(tiny_reranker_dir, tmp_path / "corrupt-reranker")
    register(client, "rr", "reranker", tiny_reranker_dir)
    ok = promote(client, 1, "staging", model="rr")
    assert ok.status_code == 200, ok.text
    checks = {c["name"]: c["passed"] for c in ok.json()["validation"]["checks"]}
    assert checks == {"load": True, "scores": True, "finite": True}

    # The eval set holds the version to the order it ranks documents in today.
    query, documents = "where do cats sleep", ["cats sleep on the sofa", "stock prices fell"]
    r = client.post("/v1/rerank", json={"model": "rr", "query": query, "documents": documents})
    assert r.status_code == 200, r.text
    top = r.json()["results"][0]["index"]
    case = {"query": query, "documents": documents}
    register(
        client,
        "rr",
        "reranker",
        tiny_reranker_dir,
        eval_set={"cases": [{**case, "expect_top": top}]},
    )
    register(
        client,
        "rr",
        "reranker",
        tiny_reranker_dir,
        eval_set={"cases": [{**case, "expect_top": 1 - top}]},
    )
    register(client, "rr", "reranker", corrupt)
    passed = promote(client, 2, "staging", model="rr")
    assert passed.status_code == 200, passed.text
    checks = {c["name"]: c for c in passed.json()["validation"]["checks"]}
    assert checks["eval_set"]["passed"] and "1/1 cases passed" in checks["eval_set"]["detail"]
    wrong = promote(client, 3, "staging", model="rr")
    assert wrong.status_code == 422
    assert f"expected document {1 - top}" in wrong.json()["error"]["message"]
    broken = promote(client, 4, "staging", model="rr")
    assert (
        broken.status_code == 422
        and "NaN or inf in the scores" in broken.json()["error"]["message"]
    )
    assert client.get("/v1/models").json()["data"][0]["aliases"] == {"staging": 2}
