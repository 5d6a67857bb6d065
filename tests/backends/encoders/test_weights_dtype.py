"""Encoders on a GPU run in half precision unless told otherwise: the dtype a load picks, the
memory the manager charges for it, and (on a CUDA machine) vectors and scores that agree with
sentence-transformers' float32 ones."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

from backends.base import BackendContext
from backends.encoders.embedder import EmbedderBackend
from backends.encoders.encoder import weights_dtype
from backends.encoders.reranker import RerankerBackend
from backends.loading import safetensors_files
from tests.backends.encoders.test_embedder import cosine, sentences, st_encode


def test_a_float32_checkpoint_runs_in_float16_on_cuda_and_as_stored_elsewhere(
    tiny_embedder_dir: Path, tiny_reranker_dir: Path
) -> None:
    for folder in (tiny_embedder_dir, tiny_reranker_dir):
        files = safetensors_files(folder)
        assert weights_dtype(files, "cuda:0", None) is torch.float16
        assert weights_dtype(files, "cpu", None) is None
        # A configured dtype wins on every device.
        assert weights_dtype(files, "cuda:0", torch.float32) is torch.float32
        assert weights_dtype(files, "cpu", torch.bfloat16) is torch.bfloat16


def test_a_16_bit_checkpoint_keeps_its_own_dtype_on_cuda(
    tiny_embedder_dir: Path, tmp_path: Path
) -> None:
    from safetensors.torch import load_file, save_file

    (source,) = safetensors_files(tiny_embedder_dir)
    weights = {k: v.to(torch.bfloat16) if v.is_floating_point() else v
               for k, v in load_file(source).items()}  # fmt: skip
    save_file(weights, tmp_path / "model.safetensors")
    assert weights_dtype([tmp_path / "model.safetensors"], "cuda:0", None) is torch.bfloat16


@pytest.mark.parametrize("backend", [EmbedderBackend, RerankerBackend])
def test_the_charge_follows_the_dtype_the_weights_load_in(
    backend: type[EmbedderBackend] | type[RerankerBackend],
    tiny_embedder_dir: Path,
    tiny_reranker_dir: Path,
) -> None:
    folder = tiny_embedder_dir if backend is EmbedderBackend else tiny_reranker_dir
    full = backend.predict_memory(folder, {}, device="cpu")
    half = backend.predict_memory(folder, {"dtype": "bfloat16"}, device="cpu")
    weights = sum(p.stat().st_size for p in safetensors_files(folder))
    # The fixed allowance is the same; the weights' share halves.
    assert full - half == pytest.approx(weights / 2, rel=0.05)
    on_gpu = backend.predict_memory(folder, {}, device="cuda:0")
    kept = backend.predict_memory(folder, {"dtype": "float32"}, device="cuda:0")
    assert on_gpu < kept
    assert on_gpu == backend.predict_memory(folder, {"dtype": "float16"}, device="cuda:0")


@pytest.mark.cuda
def test_half_precision_vectors_and_scores_agree_with_float32_ones(
    tiny_embedder_dir: Path, tiny_reranker_dir: Path
) -> None:
    from sentence_transformers import CrossEncoder

    texts = sentences(24, seed=5)
    embedder = EmbedderBackend(BackendContext("emb", "1", metrics_registry=CollectorRegistry()))
    embedder.load(tiny_embedder_dir, "cuda:0")
    try:
        assert next(embedder.model.parameters()).dtype is torch.float16
        got = asyncio.run(embedder.embed(texts)).vectors
    finally:
        embedder.unload()
    assert got.dtype == np.float32
    assert cosine(got, st_encode(tiny_embedder_dir, texts)).min() > 0.999

    reranker = RerankerBackend(BackendContext("rr", "1", metrics_registry=CollectorRegistry()))
    reranker.load(tiny_reranker_dir, "cuda:0")
    try:
        scores = asyncio.run(reranker.rerank(texts[0], texts[1:])).scores
    finally:
        reranker.unload()
    expected = CrossEncoder(str(tiny_reranker_dir), device="cpu").predict(
        [(texts[0], t) for t in texts[1:]]
    )
    assert np.allclose(scores, expected, atol=2e-2)
