"""The walking skeleton: registry -> manager -> embedder backend -> HTTP, with bad input."""

from __future__ import annotations

import base64
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient

SENTENCES = ["a short one", "a much longer sentence about paged attention and memory budgets", "x"]


def register(client: TestClient, name: str, kind: str, source: Path, **extra: object) -> int:
    r = client.post(
        "/admin/registry/models", json={"name": name, "kind": kind, "source": str(source), **extra}
    )
    assert r.status_code == 201, r.text
    return int(r.json()["version"])


def st_encode(folder: Path, texts: list[str]) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    return np.asarray(SentenceTransformer(str(folder), device="cpu").encode(texts))


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return np.sum(a * b, axis=1)


def test_embeddings_match_sentence_transformers(
    client: TestClient, tiny_embedder_dir: Path
) -> None:
    assert register(client, "emb", "embedder", tiny_embedder_dir) == 1
    r = client.post("/v1/embeddings", json={"model": "emb", "input": SENTENCES})
    assert r.status_code == 200, r.text
    assert r.headers["X-Hub-Model-Version"] == "1"
    body = r.json()
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    got = np.array([d["embedding"] for d in body["data"]], dtype=np.float32)
    assert cosine(got, st_encode(tiny_embedder_dir, SENTENCES)).min() >= 0.9999
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > len(SENTENCES)


def test_base64_and_single_string_and_per_model_routes(
    client: TestClient, tiny_embedder_dir: Path
) -> None:
    register(client, "emb", "embedder", tiny_embedder_dir)
    register(client, "emb", "embedder", tiny_embedder_dir)
    floats = client.post("/v1/embeddings", json={"model": "emb@1", "input": "hello"}).json()
    b64 = client.post(
        "/v1/embeddings", json={"model": "emb@1", "input": "hello", "encoding_format": "base64"}
    ).json()
    decoded = np.frombuffer(base64.b64decode(b64["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(decoded, floats["data"][0]["embedding"], rtol=1e-6)
    routed = client.post("/models/emb/embed", json={"input": ["hello"]})
    assert routed.headers["X-Hub-Model-Version"] == "2"  # latest, no production alias
    pinned = client.post("/models/emb/versions/1/embed", json={"input": ["hello"]})
    assert pinned.headers["X-Hub-Model-Version"] == "1"
    np.testing.assert_allclose(pinned.json()["data"][0]["embedding"], decoded, rtol=1e-5)


def test_production_alias_is_served_over_latest(
    client: TestClient, tiny_embedder_dir: Path, tiny_embedder_v2_dir: Path
) -> None:
    register(client, "emb", "embedder", tiny_embedder_dir, aliases=["production"])
    register(client, "emb", "embedder", tiny_embedder_v2_dir)
    r = client.post("/v1/embeddings", json={"model": "emb", "input": "hi"})
    assert r.headers["X-Hub-Model-Version"] == "1"
    r = client.post("/v1/embeddings", json={"model": "emb@production", "input": "hi"})
    assert r.headers["X-Hub-Model-Version"] == "1"
    models = client.get("/v1/models").json()["data"]
    assert [(m["id"], m["kind"], m["default_version"]) for m in models] == [("emb", "embedder", 1)]


def test_unknown_model_lists_known_names(client: TestClient, tiny_embedder_dir: Path) -> None:
    register(client, "emb", "embedder", tiny_embedder_dir)
    r = client.post("/v1/embeddings", json={"model": "nope", "input": "hi"})
    assert r.status_code == 404
    assert "known models: emb" in r.json()["error"]["message"]
    r = client.post("/v1/embeddings", json={"model": "emb@9", "input": "hi"})
    assert r.status_code == 404 and "versions: 1" in r.json()["error"]["message"]


def test_embeddings_of_a_non_embedder_is_400(client: TestClient, tiny_reranker_dir: Path) -> None:
    register(client, "rr", "reranker", tiny_reranker_dir)
    r = client.post("/v1/embeddings", json={"model": "rr", "input": "hi"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert "is a reranker" in err["message"] and err["param"] == "model"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"input": "hi"}, "model"),
        ({"model": "emb"}, "input"),
        ({"model": "emb", "input": []}, "input"),
        ({"model": "emb", "input": "hi", "encoding_format": "hex"}, "encoding_format"),
        ({"model": "emb", "input": "hi", "dimensions": 0}, "dimensions"),
        ({"model": "emb", "input": [1.5]}, "input"),
    ],
)
def test_malformed_bodies_get_422_naming_the_field(
    client: TestClient, body: dict[str, object], field: str
) -> None:
    r = client.post("/v1/embeddings", json=body)
    assert r.status_code == 422
    assert field in r.json()["error"]["message"]


def test_truncate_false_refuses_long_input(client: TestClient, tiny_embedder_dir: Path) -> None:
    register(client, "emb", "embedder", tiny_embedder_dir)
    long = "word " * 1000
    ok = client.post("/v1/embeddings", json={"model": "emb", "input": ["short", long]})
    assert ok.status_code == 200
    r = client.post(
        "/v1/embeddings", json={"model": "emb", "input": ["short", long], "truncate": False}
    )
    assert r.status_code == 400 and "input[1]" in r.json()["error"]["message"]


def test_register_refusals_via_api(client: TestClient, tmp_path: Path) -> None:
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "pytorch_model.bin").write_bytes(b"not really")
    (tmp_path / "w" / "tokenizer.json").write_text("{}")
    r = client.post(
        "/admin/registry/models",
        json={"name": "m", "kind": "embedder", "source": str(tmp_path / "w")},
    )
    assert r.status_code == 400 and "pickle" in r.json()["error"]["message"]
    r = client.post("/admin/registry/models", json={"name": "m", "kind": "toaster", "source": "x"})
    assert r.status_code == 422 and "kind" in r.json()["error"]["message"]
    assert client.get("/v1/models").json()["data"] == []


def test_admin_load_unload_and_status(client: TestClient, tiny_embedder_dir: Path) -> None:
    register(client, "emb", "embedder", tiny_embedder_dir)
    assert client.get("/admin/models").json() == []
    r = client.post("/admin/models/emb/versions/1/load")
    assert r.status_code == 200 and r.json()["state"] == "loaded"
    [status] = client.get("/admin/models").json()
    assert status["measured_bytes"] > 0 and status["device"] == "cpu"
    [device] = client.get("/admin/devices").json()["devices"]
    assert device["used_bytes"] >= status["measured_bytes"]
    r = client.post("/admin/models/emb/versions/1/unload")
    assert r.json()["state"] == "unloaded"
    assert client.get("/admin/devices").json()["devices"][0]["used_bytes"] == 0
    # The next request loads it again.
    assert client.post("/v1/embeddings", json={"model": "emb", "input": "hi"}).status_code == 200


def test_health_and_metrics(client: TestClient, tiny_embedder_dir: Path) -> None:
    assert client.get("/health/live").json() == {"status": "ok"}
    assert client.get("/health/ready").json()["status"] == "ready"
    register(client, "emb", "embedder", tiny_embedder_dir)
    client.post("/v1/embeddings", json={"model": "emb", "input": "hi"})
    text = client.get("/metrics").text
    assert (
        'hub_requests_total{endpoint="embeddings",model="emb",status="200",version="1"} 1.0' in text
    )
    assert "Model Hub" in client.get("/").text
