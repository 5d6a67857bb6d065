"""Sentence-transformers embedder behind the `Backend` contract.

Pooling and normalisation are whatever the model folder's own modules say (`modules.json`):
the backend runs the same module pipeline as `SentenceTransformer.encode`, so vectors match
it. This version serves one request at a time; the dynamic batcher replaces `_run` without
changing `embed`'s contract.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from backends.base import Backend, ModelKind
from backends.errors import BackendClosedError, InputError, LoadError
from backends.loading import module_bytes, require_safe_weights, tensor_bytes_from_headers
from backends.parking import ParkedWeights, park, release

# Activations and the tokenizer on top of the weights: a small fixed allowance.
_RUNTIME_OVERHEAD_BYTES = 32 * 1024 * 1024


@dataclass(frozen=True)
class Embeddings:
    """One vector per input, in input order, and the tokens each input used."""

    vectors: np.ndarray  # (n_inputs, dim) float32
    token_counts: list[int]

    @property
    def total_tokens(self) -> int:
        return sum(self.token_counts)


class EmbedderBackend(Backend):
    kind = ModelKind.EMBEDDER

    def __init__(self, context: Any) -> None:
        super().__init__(context)
        self._model: Any = None  # sentence_transformers.SentenceTransformer
        # The weights while offloaded: one host buffer, restored by one copy.
        self._parked: ParkedWeights | None = None
        self._lock = asyncio.Lock()

    @classmethod
    def predict_memory(cls, artifact_dir: Path, runtime_config: Mapping[str, Any]) -> int:
        files = require_safe_weights(artifact_dir)
        return tensor_bytes_from_headers(files) + _RUNTIME_OVERHEAD_BYTES

    def load(self, artifact_dir: Path, device: str, dtype: torch.dtype | None = None) -> None:
        from sentence_transformers import SentenceTransformer

        require_safe_weights(artifact_dir, allow_pickle=self.context.allow_pickle)
        model_kwargs: dict[str, Any] = {"use_safetensors": not self.context.allow_pickle}
        if dtype is not None:
            model_kwargs["dtype"] = dtype
        try:
            model = SentenceTransformer(
                str(artifact_dir),
                device=device,
                local_files_only=True,
                trust_remote_code=self.context.trust_remote_code,
                model_kwargs=model_kwargs,
            )
        except Exception as e:
            raise LoadError(f"cannot load embedder from {artifact_dir}: {e}") from e
        model.eval()
        self._model = model
        self._device = device

    @property
    def dimension(self) -> int:
        dim = self._require().get_embedding_dimension()
        if dim is None:
            raise LoadError("the model does not report its embedding dimension")
        return int(dim)

    @property
    def max_tokens(self) -> int:
        return int(self._require().max_seq_length)

    def memory_bytes(self) -> int:
        if self._model is None or self._parked is not None:
            return 0
        return module_bytes(self._model)

    def offload_bytes(self) -> int:
        return module_bytes(self._require())

    def offload(self) -> None:
        if self._parked is None:
            self._parked = park(self._require())
            self._device = "cpu"

    def restore(self, device: str) -> None:
        model = self._require()
        if self._parked is not None:
            self._parked.restore(device)
            self._parked = None
        else:
            model.to(device)
        self._device = device

    def unload(self) -> None:
        if self._parked is not None:
            self._parked.discard()
        elif self._model is not None:
            release(self._model)  # frees the weights now, cycles in the model or not
        self._parked = None
        self._model = None
        self._device = None

    async def embed(
        self, inputs: Sequence[str], *, truncate: bool = True, dimensions: int | None = None
    ) -> Embeddings:
        """Embed each input string; `truncate=False` refuses inputs longer than the model's
        maximum instead of cutting them."""
        if not inputs:
            raise InputError("input must not be empty", param="input")
        if dimensions is not None:
            raise InputError(
                f"model {self.context.model} does not support `dimensions`", param="dimensions"
            )
        async with self._lock:
            return await asyncio.to_thread(self._run, list(inputs), truncate)

    def _require(self) -> Any:
        if self._model is None:
            raise BackendClosedError(f"embedder {self.context.model} is not loaded")
        return self._model

    def _run(self, texts: list[str], truncate: bool) -> Embeddings:
        model = self._require()
        if not truncate:
            lengths = [len(ids) for ids in model.tokenizer(texts)["input_ids"]]
            for i, n in enumerate(lengths):
                if n > model.max_seq_length:
                    raise InputError(
                        f"input[{i}] has {n} tokens, more than the model's maximum of "
                        f"{model.max_seq_length}, and truncate is false",
                        param="input",
                    )
        features = model.tokenize(texts)
        token_counts = [int(n) for n in features["attention_mask"].sum(dim=1)]
        device = self._device or "cpu"
        features = {k: v.to(device) if torch.is_tensor(v) else v for k, v in features.items()}
        with torch.inference_mode():
            out = model(features)["sentence_embedding"]  # (n, dim)
        vectors = out.float().cpu().numpy()
        return Embeddings(vectors=vectors, token_counts=token_counts)
