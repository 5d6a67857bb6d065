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
from backends.encoders.reranker import RerankerBackend
from backends.errors import InputError, LoadError

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


@pytest.mark.parametrize("architecture", ["bert", "roberta"])
async def test_unpadded_and_padded_batches_both_equal_predict(
    architecture: str, tiny_reranker_dir: Path, tmp_path: Path
) -> None:
    from backends.tiny import build_tiny_reranker

    folder = tiny_reranker_dir
    if architecture != "bert":
        folder = build_tiny_reranker(tmp_path / architecture, architecture=architecture)
    query, docs = "where do the gulls argue", documents(12, seed=7)
    # A pad token inside a text: RoBERTa numbers positions around it, packed or padded.
    docs[3] = "gulls [PAD] argued " + docs[3]
    want = predict(folder, query, docs)
    for unpadded in (True, False):
        config = {"max_batch_size": 8, "unpadded": unpadded}
        backend = RerankerBackend(BackendContext("rr", "1", runtime_config=config))
        backend.load(folder, "cpu")
        try:
            # Packed or not is what the batcher plans for: unpadded batches cost real tokens.
            assert backend._require().unpadded is unpadded
            assert backend._batcher is not None and backend._batcher.limits.unpadded is unpadded
            halves = await asyncio.gather(
                backend.rerank(query, docs[:6]), backend.rerank(query, docs[6:])
            )
        finally:
            backend.unload()
        got = [s for half in halves for s in half.scores]
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_cross_encoders_without_a_known_first_token_head_stay_padded(
    tiny_reranker_dir: Path,
    tiny_embedder_dir: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from sentence_transformers import CrossEncoder, SentenceTransformer
    from transformers import BertForSequenceClassification

    from backends.encoders import unpadded
    from backends.encoders.tokenization import EncoderTokenizer

    embedder = SentenceTransformer(str(tiny_embedder_dir), device="cpu")
    refusal = unpadded.UnpaddedCrossEncoder.refusal
    assert "is not one Transformer" in str(refusal(embedder))

    cross = CrossEncoder(str(tiny_reranker_dir), device="cpu")
    assert refusal(cross) is None
    classifier = cross[0].auto_model

    class ScoresLastToken(BertForSequenceClassification):  # a head we know nothing about
        pass

    classifier.__class__ = ScoresLastToken
    assert "no packed head for ScoresLastToken" in str(refusal(cross))
    classifier.__class__ = BertForSequenceClassification

    # A head that reads the wrong token: the load-time probe notices and keeps padded batches,
    # with the model's attention as it was.
    vocab = classifier.get_input_embeddings().num_embeddings
    tokenizer = EncoderTokenizer(cross[0].tokenizer, max_length=128, vocab_size=vocab)
    before = classifier.config._attn_implementation
    with monkeypatch.context() as patch:
        # Skips BERT's pooler: a head that does not compute what the model does.
        patch.setattr(unpadded, "_first_token_head", lambda c: lambda first: c.classifier(first))
        with caplog.at_level("INFO", logger="backends.encoders.unpadded"):
            assert unpadded.UnpaddedCrossEncoder.probe(cross, tokenizer) is None
    assert "packed logits differ from padded ones" in caplog.text
    assert classifier.config._attn_implementation == before
    assert unpadded.UnpaddedCrossEncoder.probe(cross, tokenizer) is not None
