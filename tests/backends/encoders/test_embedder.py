"""The batched embedder backend against sentence-transformers' own `encode` of the same folder:
concurrent requests of mixed lengths, token-id inputs, truncation, `dimensions`, metrics."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from backends.base import BackendContext
from backends.encoders.embedder import EmbedderBackend
from backends.errors import BackendClosedError, InputError, LoadError

VOCABULARY = (
    "paged attention keeps the key value cache in blocks so many sequences share one pool "
    "memory budget eviction warm tier embeddings rerank Ünïcödé 日本語 café"
)
WORDS = VOCABULARY.split()


def sentences(n: int, seed: int = 0, longest: int = 60) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.randint(1, longest))) for _ in range(n)]


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return np.sum(a * b, axis=1)


def st_encode(folder: Path, texts: list[str]) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    return np.asarray(SentenceTransformer(str(folder), device="cpu").encode(texts))


def loaded(folder: Path, **config: object) -> EmbedderBackend:
    backend = EmbedderBackend(
        BackendContext("emb", "1", runtime_config=config, metrics_registry=CollectorRegistry())
    )
    backend.load(folder, "cpu")
    return backend


@pytest.fixture
def tiny(tiny_embedder_dir: Path) -> Iterator[EmbedderBackend]:
    backend = loaded(tiny_embedder_dir, max_batch_size=4)
    yield backend
    backend.unload()


async def test_minilm_concurrent_mixed_lengths_equal_encode(minilm_dir: Path) -> None:
    texts = sentences(24, longest=40)
    backend = loaded(minilm_dir, max_batch_size=8, max_batch_tokens=400)
    try:
        # One sentence per request, and two multi-sentence requests split across batches.
        singles = [backend.embed([t]) for t in texts[:16]]
        results = await asyncio.gather(*singles, backend.embed(texts[16:20]),
                                       backend.embed(texts[20:]))  # fmt: skip
    finally:
        backend.unload()
    got = np.concatenate([r.vectors for r in results])
    assert got.shape == (24, 384) and got.dtype == np.float32
    assert cosine(got, st_encode(minilm_dir, texts)).min() >= 0.9999


async def test_unpadded_and_padded_batches_agree_and_both_equal_encode(
    tiny_embedder_dir: Path,
) -> None:
    texts = sentences(16, seed=3, longest=50)
    expected = st_encode(tiny_embedder_dir, texts)
    for unpadded in (True, False):
        backend = loaded(tiny_embedder_dir, unpadded=unpadded, max_batch_size=16)
        try:
            # Packed or not is what the batcher plans for: unpadded batches cost real tokens.
            assert backend._require().unpadded is unpadded
            assert backend._batcher is not None and backend._batcher.limits.unpadded is unpadded
            results = await asyncio.gather(*(backend.embed([t]) for t in texts))
            # The model still answers sentence-transformers' own padded encode unchanged.
            direct = np.asarray(backend.model.encode(texts[:4]))  # type: ignore[operator]
        finally:
            backend.unload()
        got = np.concatenate([r.vectors for r in results])
        assert cosine(got, expected).min() >= 0.9999
        assert cosine(direct, expected[:4]).min() >= 0.9999


def test_pipelines_that_cannot_run_unpadded_stay_padded(
    tiny_embedder_dir: Path, tiny_reranker_dir: Path
) -> None:
    from sentence_transformers import CrossEncoder, SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    from backends.encoders.unpadded import UnpaddedEncoder

    cross = CrossEncoder(str(tiny_reranker_dir), device="cpu")
    assert "does not start with Transformer, Pooling" in str(UnpaddedEncoder.refusal([cross.model]))
    embedder = SentenceTransformer(str(tiny_embedder_dir), device="cpu")
    assert UnpaddedEncoder.refusal(embedder) is None
    unusual = [embedder[0], embedder[1], Pooling(embedder[1].embedding_dimension)]
    assert "read token embeddings after Pooling" in str(UnpaddedEncoder.refusal(unusual))
    embedder[0].auto_model.config.is_decoder = True
    assert UnpaddedEncoder.refusal(embedder) == "the model is a decoder"


def test_a_bad_unpadded_setting_fails_the_load(tiny_embedder_dir: Path) -> None:
    with pytest.raises(LoadError, match=r"unpadded: .*'yes'"):
        loaded(tiny_embedder_dir, unpadded="yes")


async def test_token_ids_embed_like_their_text(
    tiny: EmbedderBackend, tiny_embedder_dir: Path
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_embedder_dir)
    texts = ["the harbour town woke", "memory budget"]
    ids = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    by_text = await tiny.embed(texts)
    by_ids = await tiny.embed([ids[0], texts[1]])
    assert cosine(by_text.vectors, by_ids.vectors).min() >= 0.9999
    # Usage counts what the model ran: content plus [CLS] and [SEP].
    assert by_ids.token_counts == by_text.token_counts == [len(i) + 2 for i in ids]
    with pytest.raises(InputError, match=r"input\[1\] holds token id 99999") as e:
        await tiny.embed([ids[0], [5, 99999]])
    assert e.value.param == "input"


async def test_long_inputs_truncate_like_encode_or_are_refused(
    tiny: EmbedderBackend, tiny_embedder_dir: Path
) -> None:
    from transformers import AutoTokenizer

    long = " ".join(sentences(1, seed=3, longest=1)[0] for _ in range(300))
    texts = ["short", long]
    result = await tiny.embed(texts)
    assert result.token_counts[1] == tiny.max_tokens == 128
    assert cosine(result.vectors, st_encode(tiny_embedder_dir, texts)).min() >= 0.9999
    with pytest.raises(InputError, match=r"input\[1\] has \d+ tokens, more than .* 128"):
        await tiny.embed(texts, truncate=False)
    ids = AutoTokenizer.from_pretrained(tiny_embedder_dir).encode(long, add_special_tokens=False)
    cut = await tiny.embed([ids])
    np.testing.assert_allclose(cut.vectors[0], result.vectors[1], atol=1e-5)
    with pytest.raises(InputError, match=r"input\[0\] has"):
        await tiny.embed([ids], truncate=False)


async def test_dimensions_only_where_the_model_allows(tiny_embedder_dir: Path) -> None:
    plain = loaded(tiny_embedder_dir)
    matryoshka = loaded(tiny_embedder_dir, matryoshka_dims=[16, 8])
    try:
        full = (await plain.embed(["hello world"])).vectors[0]
        with pytest.raises(InputError, match="cannot be truncated to 16") as e:
            await plain.embed(["hello world"], dimensions=16)
        assert e.value.param == "dimensions"
        assert (await plain.embed(["hello world"], dimensions=32)).vectors.shape == (1, 32)
        short = (await matryoshka.embed(["hello world"], dimensions=16)).vectors[0]
        np.testing.assert_allclose(short, full[:16] / np.linalg.norm(full[:16]), rtol=1e-5)
        with pytest.raises(InputError, match="allows: 16, 8"):
            await matryoshka.embed(["hello world"], dimensions=12)
    finally:
        plain.unload()
        matryoshka.unload()
    with pytest.raises(LoadError, match="matryoshka_dims"):
        loaded(tiny_embedder_dir, matryoshka_dims=[64])
    with pytest.raises(LoadError, match="max_batch_size"):
        EmbedderBackend(BackendContext("emb", "1", runtime_config={"max_batch_size": 0}))


async def test_metrics_count_batches_with_model_and_version(tiny_embedder_dir: Path) -> None:
    registry = CollectorRegistry()
    backend = EmbedderBackend(BackendContext("emb", "7", metrics_registry=registry))
    backend.load(tiny_embedder_dir, "cpu")
    result = await backend.embed(["one", "two words"])
    backend.unload()
    labels = {"model": "emb", "version": "7"}
    assert registry.get_sample_value("hub_batch_size_count", labels) == 1
    assert registry.get_sample_value("hub_batch_size_sum", labels) == 2
    assert registry.get_sample_value("hub_batch_tokens_sum", labels) == result.total_tokens
    assert registry.get_sample_value("hub_batch_queue_seconds_count", labels) == 1
    assert registry.get_sample_value("hub_batch_request_seconds_count", labels) == 1


async def test_unloaded_embedder_refuses_work(tiny_embedder_dir: Path) -> None:
    backend = loaded(tiny_embedder_dir)
    assert backend.memory_bytes() > 0
    await backend.aclose()
    backend.unload()
    assert backend.memory_bytes() == 0 and backend.device is None
    with pytest.raises(BackendClosedError):
        await backend.embed(["hi"])
