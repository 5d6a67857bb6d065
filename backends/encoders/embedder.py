"""Sentence-transformers embedder behind the `Backend` contract, with dynamic batching.

Pooling and normalisation are whatever the model folder's own modules say (`modules.json`):
each batch runs the loaded `SentenceTransformer`'s module pipeline (Transformer -> Pooling ->
Normalize ...) on inputs tokenized as its `encode` tokenizes them, so vectors equal `encode`'s
up to float noise. On a CPU a batch runs unpadded, packed into one row
(`backends.encoders.unpadded`), where the pipeline allows it exactly. Concurrent requests share
batches (`backends.encoders.batching`); one request's inputs may span several batches and come
back in order.

Runtime config (a version's `config` at registration; all optional): the batching keys of
`BatchLimits` (`max_batch_tokens`, `max_batch_size`, `batch_wait_ms`, `max_queue`),
`max_seq_length` (lower the model's maximum input tokens), `matryoshka_dims` (the
`dimensions` a request may ask for, e.g. `[256, 128, 64]`, for models trained to be truncated)
and `unpadded` (true / false; by default true on a CPU).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from backends.base import BackendContext, ModelKind
from backends.encoders.encoder import (
    BatchedEncoderBackend,
    model_max_length,
    sentence_transformers_kwargs,
    unpadded_setting,
    weights_dtype,
)
from backends.encoders.tokenization import Encoded, EncoderTokenizer
from backends.encoders.unpadded import UnpaddedEncoder, padded_embed
from backends.errors import InputError, LoadError
from backends.loading import require_safe_weights
from backends.runtime_config import EmbedderConfig
from backends.text_input import require_encodable

# One input: a text, or content token ids (no special tokens).
EmbedInput = str | Sequence[int]
# One input's result: its vector and the tokens it used.
_Row = tuple[np.ndarray, int]


@dataclass(frozen=True)
class Embeddings:
    """One vector per input, in input order, and the tokens each input used (special tokens
    included, after truncation)."""

    vectors: np.ndarray  # (n_inputs, dim) float32
    token_counts: list[int]

    @property
    def total_tokens(self) -> int:
        return sum(self.token_counts)


@dataclass(frozen=True)
class _EmbedRequest:
    inputs: Sequence[EmbedInput]
    truncate: bool


class _EmbedStages:
    """Tokenize requests' inputs; run a batch through the module pipeline, packed into one
    row when `packed` is set (`backends.encoders.unpadded`), else padded."""

    def __init__(
        self,
        model: Any,
        tokenizer: EncoderTokenizer,
        device: str,
        packed: UnpaddedEncoder | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.device = device
        self.packed = packed
        self.unpadded = packed is not None

    def tokenize(self, payloads: Sequence[_EmbedRequest]) -> list[list[Encoded] | BaseException]:
        # The texts of every request that arrived together go through one tokenizer call.
        texts = [x for p in payloads for x in p.inputs if isinstance(x, str)]
        encoded = iter(self.tokenizer.encode(texts) if texts else ())
        out: list[list[Encoded] | BaseException] = []
        for request in payloads:
            mine = [next(encoded) for x in request.inputs if isinstance(x, str)]
            try:
                out.append(self._finish(request, iter(mine)))
            except InputError as e:
                out.append(e)
        return out

    def _finish(self, request: _EmbedRequest, texts: Iterator[Encoded]) -> list[Encoded]:
        """The request's inputs in order: its texts (encoded, in order, in `texts`) and its
        token-id inputs (wrapped here); over-long ones refused or truncated."""
        tok = self.tokenizer
        items: list[Encoded] = []
        cut_texts: list[tuple[int, str]] = []  # over-long texts to encode again, truncated
        for i, value in enumerate(request.inputs):
            e = next(texts) if isinstance(value, str) else self._wrap_ids(i, value)
            if e.length > tok.max_length:
                if not request.truncate:
                    raise InputError(
                        f"input[{i}] has {e.length} tokens, more than the model's maximum of "
                        f"{tok.max_length}, and truncate is false; shorten it or allow "
                        "truncation",
                        param="input",
                    )
                if isinstance(value, str):
                    cut_texts.append((i, value))
                else:
                    e = tok.wrap_ids(value, truncate=True)
            items.append(e)
        if cut_texts:
            cut = tok.encode_truncated([text for _, text in cut_texts])
            for (i, _), e in zip(cut_texts, cut, strict=True):
                items[i] = e
        return items

    def _wrap_ids(self, index: int, ids: Sequence[int]) -> Encoded:
        bad = self.tokenizer.first_invalid_id(ids)
        if bad is not None:
            raise InputError(
                f"input[{index}] holds token id {bad}, outside the model's vocabulary of "
                f"{self.tokenizer.vocab_size} ids",
                param="input",
            )
        return self.tokenizer.wrap_ids(ids)

    def forward(self, items: Sequence[Encoded]) -> list[_Row]:
        with torch.inference_mode():
            if self.packed is not None:
                out = self.packed.embed(items, self.device)  # (n, dim)
            else:
                out = padded_embed(self.model, self.tokenizer, items, self.device)
        vectors = out.float().cpu().numpy()
        return [(vectors[i], item.length) for i, item in enumerate(items)]


class EmbedderBackend(BatchedEncoderBackend[_EmbedRequest, _Row, EmbedderConfig]):
    """A sentence-transformers embedder; `embed` batches concurrent requests together."""

    kind = ModelKind.EMBEDDER

    def __init__(self, context: BackendContext) -> None:
        super().__init__(context, EmbedderConfig)
        # Largest first (the config model sorts them).
        self._matryoshka = tuple(self.config.matryoshka_dims or ())
        self._dimension = 0
        self._normalized = False

    def load(self, artifact_dir: Path, device: str, dtype: torch.dtype | None = None) -> None:
        from sentence_transformers import SentenceTransformer

        files = require_safe_weights(artifact_dir, allow_pickle=self.context.allow_pickle)
        dtype = weights_dtype(files, device, dtype)
        try:
            model = SentenceTransformer(
                str(artifact_dir), device=device, **sentence_transformers_kwargs(self, dtype)
            )
        except Exception as e:
            raise LoadError(f"cannot load embedder from {artifact_dir}: {e}") from e
        model.eval()
        dim = model.get_embedding_dimension()
        if dim is None:
            raise LoadError(f"{artifact_dir}: the model does not report its embedding dimension")
        too_wide = [d for d in self._matryoshka if d > dim]
        if too_wide:
            raise LoadError(
                f"runtime config matryoshka_dims {too_wide} exceed the model's {dim} dimensions"
            )
        transformer: Any = model[0]
        tokenizer = EncoderTokenizer(
            transformer.tokenizer,
            max_length=model_max_length(model, self.config.max_seq_length),
            vocab_size=transformer.auto_model.get_input_embeddings().num_embeddings,
        )
        self._dimension = int(dim)
        self._normalized = any(type(m).__name__ == "Normalize" for m in model)
        packed = None
        if unpadded_setting(self.config, device):
            packed = UnpaddedEncoder.probe(model, tokenizer)
        self._start(_EmbedStages(model, tokenizer, device, packed), device)

    @property
    def dimension(self) -> int:
        """Dimensions of the model's vectors."""
        self._require()
        return self._dimension

    async def embed(
        self,
        inputs: Sequence[EmbedInput],
        *,
        truncate: bool = True,
        dimensions: int | None = None,
        priority: int = 0,
    ) -> Embeddings:
        """Embed each input: a text, or content token ids (the model's special tokens are
        added). `priority`: the request's level (`backends.priority`), lower batched first.
        `truncate=False` refuses inputs longer than the model's maximum instead of cutting
        them; `dimensions` keeps the first that many dimensions (renormalised when the model
        normalises), allowed for the model's `matryoshka_dims`. Raises InputError naming the
        offending input, CapacityError when the queue is full."""
        if not inputs:
            raise InputError("input must not be empty", param="input")
        require_encodable(inputs, "input")
        tokenizer = self._require().tokenizer
        # A text too long to fit is cut (or refused) before its tokenizing costs anything.
        inputs = [
            tokenizer.bounded(x, truncate=truncate, param="input", what=f"input[{i}]")
            if isinstance(x, str)
            else x
            for i, x in enumerate(inputs)
        ]
        if dimensions not in (None, self._dimension, *self._matryoshka):
            allowed = ", ".join(str(d) for d in self._matryoshka) or "none"
            raise InputError(
                f"model {self.context.model} gives {self._dimension}-dimensional vectors and "
                f"cannot be truncated to {dimensions} (dimensions it allows: {allowed}, set by "
                "the runtime config key matryoshka_dims)",
                param="dimensions",
            )
        rows = await self._submit(_EmbedRequest(inputs, truncate), len(inputs), priority)
        vectors = np.stack([vector for vector, _ in rows])
        if dimensions is not None and dimensions != self._dimension:
            vectors = vectors[:, :dimensions]
            if self._normalized:
                norms = np.linalg.norm(vectors, axis=1, keepdims=True)
                vectors = vectors / np.maximum(norms, 1e-12)
        return Embeddings(vectors=vectors, token_counts=[n for _, n in rows])
