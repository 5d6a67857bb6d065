"""Sentence-transformers cross-encoder reranker behind the `Backend` contract, with dynamic
batching.

Each (query, document) pair is tokenized as one sequence the way `CrossEncoder.predict`
tokenizes it (`longest_first` truncation at the model's maximum), batches run the loaded
`CrossEncoder`'s module pipeline, and its own activation turns logits into scores (the one in
the model's config, else sigmoid for a one-label model, as sentence-transformers decides), so
scores equal `predict`'s. Pairs of concurrent requests share batches; one request's documents
may span several batches and come back in order.

On a CPU a batch runs unpadded, packed into one row (`backends.encoders.unpadded`), where the
classifier's head is one known to read only each pair's first token (BERT, RoBERTa,
XLM-RoBERTa) and a load-time probe finds packed logits equal to padded ones; otherwise
padded batches, as `predict` runs them.

Runtime config (all optional): the batching keys of `BatchLimits`, `max_seq_length`,
`max_documents` (documents one request may rank; default 1000) and `unpadded` (true / false;
by default true on a CPU).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
from backends.encoders.unpadded import UnpaddedCrossEncoder, padded_logits
from backends.errors import InputError, LoadError
from backends.loading import require_safe_weights
from backends.runtime_config import RerankerConfig
from backends.text_input import require_encodable

# One pair's result: its score and the tokens it used.
_Scored = tuple[float, int]


@dataclass(frozen=True)
class Scores:
    """One relevance score per document, in document order, and the tokens each pair used."""

    scores: list[float]
    token_counts: list[int]

    @property
    def total_tokens(self) -> int:
        return sum(self.token_counts)


@dataclass(frozen=True)
class _RerankRequest:
    query: str
    documents: Sequence[str]
    truncate: bool
    # Cohere's max_tokens_per_doc: each document cut to this many tokens before pairing.
    max_tokens_per_doc: int | None = None


class _RerankStages:
    """Tokenize (query, document) pairs; score a batch, packed into one row when `packed` is
    set (`backends.encoders.unpadded`), else padded, with the model's activation."""

    def __init__(
        self,
        model: Any,
        tokenizer: EncoderTokenizer,
        device: str,
        packed: UnpaddedCrossEncoder | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.device = device
        self.activation = model.activation_fn
        self.packed = packed
        self.unpadded = packed is not None

    def tokenize(self, payloads: Sequence[_RerankRequest]) -> list[list[Encoded] | BaseException]:
        documents = [self._documents(p) for p in payloads]
        # The pairs of every request that arrived together go through one tokenizer call.
        pairs = [(p.query, d) for p, docs in zip(payloads, documents, strict=True) for d in docs]
        encoded = iter(self.tokenizer.encode(pairs))
        out: list[list[Encoded] | BaseException] = []
        for request, docs in zip(payloads, documents, strict=True):
            mine = [next(encoded) for _ in docs]
            try:
                out.append(self._finish(request, docs, mine))
            except InputError as e:
                out.append(e)
        return out

    def _documents(self, request: _RerankRequest) -> Sequence[str]:
        if request.max_tokens_per_doc is None:
            return request.documents
        return self.tokenizer.keep_first_tokens(request.documents, request.max_tokens_per_doc)

    def _finish(
        self, request: _RerankRequest, documents: Sequence[str], encoded: list[Encoded]
    ) -> list[Encoded]:
        limit = self.tokenizer.max_length
        too_long = [i for i, e in enumerate(encoded) if e.length > limit]
        if too_long and not request.truncate:
            i = too_long[0]
            raise InputError(
                f"documents[{i}] with the query has {encoded[i].length} tokens, more than the "
                f"model's maximum of {limit}, and truncate is false; shorten it or allow "
                "truncation",
                param="documents",
            )
        if too_long:
            cut = self.tokenizer.encode_truncated([(request.query, documents[i]) for i in too_long])
            for i, e in zip(too_long, cut, strict=True):
                encoded[i] = e
        return encoded

    def forward(self, items: Sequence[Encoded]) -> list[_Scored]:
        with torch.inference_mode():
            if self.packed is not None:
                logits = self.packed.logits(items, self.device)  # (n, 1)
            else:
                logits = padded_logits(self.model, self.tokenizer, items, self.device)
            scores = self.activation(logits.float()).reshape(-1)  # (n,)
        return [(float(s), item.length) for s, item in zip(scores.tolist(), items, strict=True)]


class RerankerBackend(BatchedEncoderBackend[_RerankRequest, _Scored, RerankerConfig]):
    """A one-label cross-encoder; `rerank` scores documents against a query, batching the
    pairs of concurrent requests together."""

    kind = ModelKind.RERANKER

    def __init__(self, context: BackendContext) -> None:
        super().__init__(context, RerankerConfig)
        self.max_documents: int = self.config.max_documents

    def load(self, artifact_dir: Path, device: str, dtype: torch.dtype | None = None) -> None:
        from sentence_transformers import CrossEncoder

        files = require_safe_weights(artifact_dir, allow_pickle=self.context.allow_pickle)
        dtype = weights_dtype(files, device, dtype)
        try:
            model = CrossEncoder(
                str(artifact_dir), device=device, **sentence_transformers_kwargs(self, dtype)
            )
        except Exception as e:
            raise LoadError(f"cannot load reranker from {artifact_dir}: {e}") from e
        if model.num_labels != 1:
            raise LoadError(
                f"{artifact_dir}: a reranker needs one relevance score per pair, but this "
                f"cross-encoder has {model.num_labels} labels"
            )
        model.eval()
        transformer: Any = model[0]
        tokenizer = EncoderTokenizer(
            transformer.tokenizer,
            max_length=model_max_length(model, self.config.max_seq_length),
            vocab_size=transformer.auto_model.get_input_embeddings().num_embeddings,
        )
        packed = None
        if unpadded_setting(self.config, device):
            packed = UnpaddedCrossEncoder.probe(model, tokenizer)
        self._start(_RerankStages(model, tokenizer, device, packed), device)

    async def rerank(
        self,
        query: str,
        documents: Sequence[str],
        *,
        truncate: bool = True,
        max_tokens_per_doc: int | None = None,
        priority: int = 0,
    ) -> Scores:
        """Score each document against `query`, in document order; `priority`: the request's
        level (`backends.priority`), lower batched first. With `max_tokens_per_doc`
        each document is first cut to its first that many tokens (Cohere's field). A pair
        longer than the model's maximum is truncated (`longest_first`) unless
        `truncate=False`, which refuses it. Raises InputError for an empty query, no
        documents or more than `max_documents`, CapacityError when the queue is full."""
        if max_tokens_per_doc is not None and max_tokens_per_doc < 1:
            raise InputError("max_tokens_per_doc must be at least 1", param="max_tokens_per_doc")
        if not query.strip():
            raise InputError("query must not be empty", param="query")
        require_encodable(query, "query")
        require_encodable(documents, "documents")
        if not documents:
            raise InputError("documents must not be empty", param="documents")
        if len(documents) > self.max_documents:
            raise InputError(
                f"{len(documents)} documents is more than model {self.context.model} ranks in "
                f"one request ({self.max_documents}, runtime config max_documents); split them",
                param="documents",
            )
        tokenizer = self._require().tokenizer
        # Texts too long to fit are cut (or refused) before their tokenizing costs anything;
        # a document is cut whenever it will be cut to max_tokens_per_doc anyway.
        query = tokenizer.bounded(query, truncate=truncate, param="query", what="query")
        cut_documents = truncate or max_tokens_per_doc is not None
        documents = [
            tokenizer.bounded(d, truncate=cut_documents, param="documents", what=f"documents[{i}]")
            for i, d in enumerate(documents)
        ]
        request = _RerankRequest(query, documents, truncate, max_tokens_per_doc)
        scored = await self._submit(request, len(documents), priority)
        return Scores(scores=[s for s, _ in scored], token_counts=[n for _, n in scored])
