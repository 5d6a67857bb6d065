"""Rerank in the shapes other clients speak: Cohere's SDK (v2 and v1 clients) against a live
hub, Cohere v2's `max_tokens_per_doc` and `meta`, TEI's `/rerank`, and Jina's body on
`/rerank`. Scores are the model's (`CrossEncoder.predict`) in every shape."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient

from hub.settings import HubSettings
from tests.hub.api.test_rerank import DOCUMENTS, QUERY, predict, register
from tests.support.live import live_hub


def first_tokens(folder: Path, text: str, n: int) -> str:
    """`text` cut after its first `n` tokens, by the model's own tokenizer."""
    from transformers import AutoTokenizer

    offsets = AutoTokenizer.from_pretrained(folder)(
        text, add_special_tokens=False, return_offsets_mapping=True
    )["offset_mapping"]
    return text if len(offsets) <= n else text[: offsets[n - 1][1]]


@pytest.fixture
def reranker(client: TestClient, tiny_reranker_dir: Path) -> TestClient:
    register(client, "rr", "reranker", tiny_reranker_dir)
    return client


def test_cohere_sdk_v2_and_v1_clients(settings: HubSettings, tiny_reranker_dir: Path) -> None:
    import cohere

    want = predict(tiny_reranker_dir, QUERY, DOCUMENTS)
    order = list(np.argsort(-want, kind="stable"))
    with live_hub(settings) as (base, _app):
        r = httpx.post(
            f"{base}/admin/registry/models",
            json={"name": "rr", "kind": "reranker", "source": str(tiny_reranker_dir)},
        )
        assert r.status_code == 201, r.text

        # ClientV2, as langchain-cohere calls it.
        v2 = cohere.ClientV2(api_key="unused", base_url=base)
        answer = v2.rerank(model="rr", query=QUERY, documents=DOCUMENTS, top_n=3)
        assert [x.index for x in answer.results] == order[:3]
        np.testing.assert_allclose([x.relevance_score for x in answer.results],
                                   want[order[:3]], atol=1e-5)  # fmt: skip
        assert answer.id and answer.meta is not None
        assert answer.meta.api_version is not None and answer.meta.api_version.version == "2"
        assert answer.meta.billed_units is not None
        assert answer.meta.billed_units.search_units == 1
        assert answer.meta.tokens is not None and answer.meta.tokens.input_tokens > len(DOCUMENTS)

        # The v1 client, documents as objects, returned on request.
        v1 = cohere.Client(api_key="unused", base_url=base)
        documents = [{"text": d} for d in DOCUMENTS]
        answer1 = v1.rerank(model="rr@1", query=QUERY, documents=documents,
                            return_documents=True)  # fmt: skip
        assert [x.index for x in answer1.results] == order
        assert [x.document.text for x in answer1.results if x.document] == [
            DOCUMENTS[i] for i in order
        ]

        # Errors are the SDK's: an unknown model, a field the hub does not know.
        with pytest.raises(cohere.NotFoundError):
            v2.rerank(model="ghost", query=QUERY, documents=DOCUMENTS)
        with pytest.raises(cohere.BadRequestError):
            v2.rerank(model="rr", query=QUERY, documents=DOCUMENTS,
                      relevant_spans={"mode": "enabled"})  # fmt: skip


def test_max_tokens_per_doc_scores_the_first_tokens(
    reranker: TestClient, tiny_reranker_dir: Path
) -> None:
    body = {"model": "rr", "query": QUERY, "documents": DOCUMENTS}
    full = reranker.post("/v2/rerank", json=body).json()
    cut = reranker.post("/v2/rerank", json={**body, "max_tokens_per_doc": 4}).json()
    shortened = [first_tokens(tiny_reranker_dir, d, 4) for d in DOCUMENTS]
    assert shortened != DOCUMENTS  # the cut changes some documents ...
    want = predict(tiny_reranker_dir, QUERY, shortened)
    got = {x["index"]: x["relevance_score"] for x in cut["results"]}
    np.testing.assert_allclose([got[i] for i in range(len(DOCUMENTS))], want, atol=1e-5)
    # ... and uses fewer tokens.
    assert cut["meta"]["tokens"]["input_tokens"] < full["meta"]["tokens"]["input_tokens"]
    # Documents come back whole, as sent.
    r = reranker.post("/v2/rerank", json={**body, "max_tokens_per_doc": 4, "top_n": 1,
                                          "return_documents": True})  # fmt: skip
    (best,) = r.json()["results"]
    assert best["document"]["text"] == DOCUMENTS[best["index"]]
    r = reranker.post("/v2/rerank", json={**body, "max_tokens_per_doc": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens_per_doc"


def test_tei_rerank(reranker: TestClient, tiny_reranker_dir: Path) -> None:
    texts = DOCUMENTS[:3]
    r = reranker.post("/rerank", json={"query": QUERY, "texts": texts, "return_text": True})
    assert r.status_code == 200, r.text
    assert r.headers["X-Hub-Model-Version"] == "1"
    ranks = r.json()
    want = predict(tiny_reranker_dir, QUERY, texts)
    assert [x["index"] for x in ranks] == list(np.argsort(-want, kind="stable"))
    np.testing.assert_allclose([x["score"] for x in ranks], np.sort(want)[::-1], atol=1e-5)
    assert [x["text"] for x in ranks] == [texts[x["index"]] for x in ranks]
    plain = reranker.post("/rerank", json={"query": QUERY, "texts": texts, "model": "rr"})
    assert all(set(x) == {"index", "score"} for x in plain.json())

    # TEI refuses an over-long pair unless asked to truncate.
    long = [DOCUMENTS[3]]
    r = reranker.post("/rerank", json={"query": QUERY, "texts": long})
    assert r.status_code == 400 and "truncate" in r.json()["error"]["message"]
    assert reranker.post("/rerank", json={"query": QUERY, "texts": long,
                                          "truncate": True}).status_code == 200  # fmt: skip
    r = reranker.post("/rerank", json={"query": QUERY, "texts": texts, "raw_scores": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "raw_scores"

    # Without `model`, the one reranker; with two, the caller must choose.
    register(reranker, "rr2", "reranker", tiny_reranker_dir)
    r = reranker.post("/rerank", json={"query": QUERY, "texts": texts})
    assert r.status_code == 400 and "rerankers: rr, rr2" in r.json()["error"]["message"]


def test_tei_rerank_keeps_the_top_n(reranker: TestClient, tiny_reranker_dir: Path) -> None:
    # The body litellm's `huggingface/` rerank provider sends for `top_n=2`.
    texts = [DOCUMENTS[i] for i in (0, 1, 2, 4)]
    body = {"raw_scores": False, "truncate": False, "truncation_direction": "Right",
            "query": QUERY, "texts": texts, "top_n": 2, "return_text": True}  # fmt: skip
    r = reranker.post("/rerank", json=body)
    assert r.status_code == 200, r.text
    want = predict(tiny_reranker_dir, QUERY, texts)
    order = [int(i) for i in np.argsort(-want, kind="stable")]
    assert [x["index"] for x in r.json()] == order[:2]
    assert [x["text"] for x in r.json()] == [texts[i] for i in order[:2]]
    everything = reranker.post("/rerank", json={**body, "top_n": 10})
    assert [x["index"] for x in everything.json()] == order
    r = reranker.post("/rerank", json={**body, "top_n": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_n"


def test_jina_body_on_rerank_answers_as_v1(reranker: TestClient) -> None:
    body = {"model": "rr", "query": QUERY, "documents": DOCUMENTS, "top_n": 2,
            "return_documents": True}  # fmt: skip
    jina = reranker.post("/rerank", json=body).json()
    v1 = reranker.post("/v1/rerank", json=body).json()
    assert jina["results"] == v1["results"] and jina["usage"] == v1["usage"]
    assert [x["document"]["text"] for x in jina["results"]] == [
        DOCUMENTS[x["index"]] for x in jina["results"]
    ]
    r = reranker.post("/rerank", json={"model": "rr", "query": QUERY, "documents": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "documents"
    # Cohere v1's chunking fields are refused by name, not silently ignored.
    for field, value in (("rank_fields", ["title"]), ("max_chunks_per_doc", 3)):
        r = reranker.post("/v1/rerank", json={**body, field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field
