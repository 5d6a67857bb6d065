"""Rerank over HTTP, Cohere-style: order and scores equal `CrossEncoder.predict`, `top_n` and
`return_documents` as in Cohere's API, per-model and per-version routes, bad input."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient

QUERY = "when does the ferry leave the harbour"
DOCUMENTS = [
    "The ferry leaves the harbour at nine every morning.",
    "Gulls argued over the nets.",
    "fog",
    "The harbour town woke to fog and the ferry waited " * 20,  # longer than the model takes
    "Timetables are posted by the harbour master's office.",
]


def register(client: TestClient, name: str, kind: str, source: Path, **extra: object) -> int:
    r = client.post(
        "/admin/registry/models", json={"name": name, "kind": kind, "source": str(source), **extra}
    )
    assert r.status_code == 201, r.text
    return int(r.json()["version"])


def predict(folder: Path, query: str, documents: list[str]) -> np.ndarray:
    from sentence_transformers import CrossEncoder

    model = CrossEncoder(str(folder), device="cpu")
    return np.asarray(model.predict([(query, d) for d in documents]))


@pytest.fixture
def reranker(client: TestClient, tiny_reranker_dir: Path) -> TestClient:
    register(client, "rr", "reranker", tiny_reranker_dir, config={"max_documents": 5})
    return client


def test_order_and_scores_equal_cross_encoder_predict(
    reranker: TestClient, tiny_reranker_dir: Path
) -> None:
    r = reranker.post("/v1/rerank", json={"model": "rr", "query": QUERY, "documents": DOCUMENTS})
    assert r.status_code == 200, r.text
    assert r.headers["X-Hub-Model-Version"] == "1"
    body = r.json()
    want = predict(tiny_reranker_dir, QUERY, DOCUMENTS)
    results = body["results"]
    assert [x["index"] for x in results] == list(np.argsort(-want, kind="stable"))
    np.testing.assert_allclose([x["relevance_score"] for x in results], np.sort(want)[::-1],
                               atol=1e-5)  # fmt: skip
    assert all("document" not in x for x in results)  # Cohere: only with return_documents
    assert body["model"] == "rr" and body["id"]
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] > len(DOCUMENTS)


def test_top_n_and_return_documents_as_cohere(reranker: TestClient) -> None:
    documents = [DOCUMENTS[0], {"text": DOCUMENTS[1]}, DOCUMENTS[2]]
    full = reranker.post("/v1/rerank", json={"model": "rr", "query": QUERY,
                                             "documents": documents}).json()  # fmt: skip
    r = reranker.post(
        "/v1/rerank",
        json={"model": "rr", "query": QUERY, "documents": documents, "top_n": 2,
              "return_documents": True},
    )  # fmt: skip
    top = r.json()["results"]
    assert [x["index"] for x in top] == [x["index"] for x in full["results"][:2]]
    texts = [DOCUMENTS[0], DOCUMENTS[1], DOCUMENTS[2]]
    assert [x["document"] for x in top] == [{"text": texts[x["index"]]} for x in top]
    # top_n beyond the documents returns them all.
    r = reranker.post("/v1/rerank", json={"model": "rr", "query": QUERY, "documents": documents,
                                          "top_n": 10})  # fmt: skip
    assert len(r.json()["results"]) == 3


def test_per_model_and_per_version_routes(reranker: TestClient, tiny_reranker_dir: Path) -> None:
    register(reranker, "rr", "reranker", tiny_reranker_dir)
    body = {"query": QUERY, "documents": DOCUMENTS[:2]}
    routed = reranker.post("/models/rr/rerank", json=body)
    assert routed.status_code == 200 and routed.headers["X-Hub-Model-Version"] == "2"
    pinned = reranker.post("/models/rr/versions/1/rerank", json=body)
    assert pinned.status_code == 200 and pinned.headers["X-Hub-Model-Version"] == "1"
    assert pinned.json()["results"] == routed.json()["results"]


def test_refusals(reranker: TestClient, tiny_embedder_dir: Path) -> None:
    register(reranker, "emb", "embedder", tiny_embedder_dir)
    r = reranker.post("/v1/rerank", json={"model": "emb", "query": "q", "documents": ["d"]})
    assert r.status_code == 400 and "is an embedder; reranking needs a reranker" in r.text
    r = reranker.post("/v1/embeddings", json={"model": "rr", "input": "hi"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    r = reranker.post("/v1/rerank", json={"model": "rr", "query": "q", "documents": ["d"] * 6})
    assert r.status_code == 400
    assert "6 documents" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "documents"
    long = {"model": "rr", "query": QUERY, "documents": DOCUMENTS, "truncate": False}
    r = reranker.post("/v1/rerank", json=long)
    assert r.status_code == 400 and "documents[3]" in r.json()["error"]["message"]
    assert r.headers["X-Hub-Model-Version"] == "1"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"query": "", "documents": ["d"]}, "query must not be empty"),
        ({"query": "   ", "documents": ["d"]}, "query must not be empty"),
        ({"query": "q", "documents": []}, "documents must not be an empty list"),
        ({"query": "q", "documents": ["d", 3]}, "documents[1] is int"),
        ({"query": "q", "documents": ["d", {"title": "x"}]}, "documents[1] is an object"),
        ({"query": "q", "documents": "d"}, "documents must be a list"),
        ({"query": "q", "documents": ["d"], "top_n": 0}, "top_n"),
        ({"documents": ["d"]}, "query"),
    ],
)
def test_malformed_bodies_get_400_naming_the_problem(
    reranker: TestClient, body: dict[str, object], message: str
) -> None:
    r = reranker.post("/v1/rerank", json={"model": "rr", **body})
    assert r.status_code == 400
    assert message in r.json()["error"]["message"]


def test_a_reranker_passes_the_validation_gate(reranker: TestClient) -> None:
    r = reranker.post(
        "/admin/registry/models/rr/versions/1/promote", json={"to": "staging", "reason": "try"}
    )
    assert r.status_code == 200, r.text
    validation = r.json()["validation"]
    assert validation["passed"] is True
    assert {c["name"] for c in validation["checks"]} >= {"scores", "finite"}
    body = {"model": "rr@staging", "query": QUERY, "documents": DOCUMENTS[:2]}
    assert reranker.post("/v1/rerank", json=body).status_code == 200
