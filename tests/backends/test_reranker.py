"""The batched reranker backend against sentence-transformers' own `CrossEncoder.predict` on
the same pairs: concurrent requests, long documents, refusals."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from backends.base import BackendContext
from backends.errors import InputError, LoadError
from backends.reranker import RerankerBackend

WORDS = ["the", "harbour", "town", "woke", "to", "fog", "and", "the", "ferry", "waited", "while",
         "gulls", "argued", "over", "nets"]  # fmt: skip


def documents(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    # Lengths up to ~300 tokens: some pairs exceed the tiny model's 128 and are truncated.
    return [" ".join(rng.choices(WORDS, k=rng.randint(1, 120))) for _ in range(n)]


def predict(folder: Path, query: str, docs: list[str]) -> np.ndarray:
    from sentence_transformers import CrossEncoder

    return np.asarray(CrossEncoder(str(folder), device="cpu").predict([(query, d) for d in docs]))


@pytest.fixture
def reranker(tiny_reranker_dir: Path) -> Iterator[RerankerBackend]:
    backend = RerankerBackend(
        BackendContext("rr", "1", runtime_config={"max_batch_size": 4, "max_documents": 12})
    )
    backend.load(tiny_reranker_dir, "cpu")
    yield backend
    backend.unload()


async def test_scores_equal_cross_encoder_predict(
    reranker: RerankerBackend, tiny_reranker_dir: Path
) -> None:
    queries = ["when does the ferry leave", "gulls", "fog over the harbour town"]
    docs = [documents(10, seed) for seed in range(3)]
    pending = [reranker.rerank(q, d) for q, d in zip(queries, docs, strict=True)]
    results = await asyncio.gather(*pending)
    for query, doc_list, result in zip(queries, docs, results, strict=True):
        want = predict(tiny_reranker_dir, query, doc_list)
        np.testing.assert_allclose(result.scores, want, atol=1e-5)
        # Sigmoid of the logit, as CrossEncoder's default for one label: scores in (0, 1).
        assert all(0 < s < 1 for s in result.scores)
        assert max(result.token_counts) == reranker.max_tokens == 128


async def test_refusals_name_what_is_wrong(reranker: RerankerBackend) -> None:
    long = " ".join(WORDS * 20)
    with pytest.raises(InputError, match=r"documents\[1\] with the query has \d+ tokens") as e:
        await reranker.rerank("q", ["short", long], truncate=False)
    assert e.value.param == "documents"
    with pytest.raises(InputError, match="query must not be empty"):
        await reranker.rerank("  ", ["a"])
    with pytest.raises(InputError, match="documents must not be empty"):
        await reranker.rerank("q", [])
    with pytest.raises(InputError, match=r"13 documents .* \(12, runtime config max_documents\)"):
        await reranker.rerank("q", ["d"] * 13)


def test_bad_max_documents_is_a_load_error() -> None:
    with pytest.raises(LoadError, match="max_documents"):
        RerankerBackend(BackendContext("rr", "1", runtime_config={"max_documents": 0}))
