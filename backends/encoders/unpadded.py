"""Unpadded forward passes for sentence-transformers encoders: a batch as one packed row.

A padded batch of inputs of different lengths spends compute on pad tokens in every linear
layer, so a batcher must trade batch size (fewer, cheaper passes) against padding (inputs of
unlike lengths). Packed, the inputs of a batch are concatenated into one `(1, T)` row with
positions restarting at each input, every linear layer runs on real tokens only, and
attention runs per input over its own tokens: `varlen_attention`, registered with
transformers' `AttentionInterface`, takes the inputs' bounds as the `hub_bounds` keyword of
the model's forward. The pooling module then reduces the flat output per input
(sentence-transformers' `Pooling` accepts the bounds as `cu_seq_lens_q`), and the
modules after it (`Normalize`, `Dense`) see ordinary sentence embeddings. Packed batches
cost less per input than padded ones of the same unsorted inputs (`benchmarks/packing.py`),
and batches may grow as large as the queue allows.

Only pipelines it can run exactly are packed: a `Transformer` whose model supports the
attention interface and is not a decoder, then `Pooling`, then only `Normalize` / `Dense`.
At load, `UnpaddedEncoder.probe` runs a few inputs both ways and keeps the packed path only if
they agree; anything else stays padded.

Cross-encoders (rerankers) pack the same way, `UnpaddedCrossEncoder`: the encoder runs on the
packed row, and the classification head, which reads each input's first token, gets those
tokens' states as a batch of one-token inputs. Heads are architecture-specific, so only the
ones known here are packed (BERT's pooler + classifier; RoBERTa's and XLM-RoBERTa's
classifier), each checked by the same load-time probe.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from backends.encoders.tokenization import Encoded, EncoderTokenizer

log = logging.getLogger(__name__)

ATTENTION_NAME = "hub_varlen"
# Modules after Pooling that only read and write the sentence embedding.
_SENTENCE_MODULES = {"Normalize", "Dense"}
# Inputs of the load-time probe: unlike lengths, so the padded run pads.
_PROBE_TEXTS = (
    "a short one",
    "The unpadded forward pass is checked against the padded one before it is used.",
    "hello",
)
# Cosine below which the probe refuses the packed path.
_PROBE_MIN_COSINE = 0.9999


def varlen_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # (1, H, T, D)
    key: torch.Tensor,  # (1, KV, T, D)
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    hub_bounds: Sequence[tuple[int, int]] | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Bidirectional attention of each packed input over its own tokens. A call without
    `hub_bounds` (the model run as usual, e.g. by `SentenceTransformer.encode`) is an ordinary
    padded batch and gets transformers' SDPA attention with its mask."""
    if hub_bounds is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    gqa = key.shape[1] != query.shape[1]
    out = query.new_empty(query.shape[2], query.shape[1], query.shape[3])  # (T, H, D)
    for start, end in hub_bounds:
        o = F.scaled_dot_product_attention(
            query[:, :, start:end],
            key[:, :, start:end],
            value[:, :, start:end],
            scale=scaling,
            enable_gqa=gqa,
        )
        out[start:end] = o[0].transpose(0, 1)
    return out.unsqueeze(0), None  # (1, T, H, D), as transformers' attention functions return


def register() -> None:
    """Make `ATTENTION_NAME` a valid attention implementation (idempotent); padded calls get
    SDPA's masks."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, varlen_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


class UnpaddedEncoder:
    """Runs a sentence-transformers pipeline on packed batches; see the module docstring."""

    def __init__(self, model: Any, tokenizer: EncoderTokenizer) -> None:
        self.tokenizer = tokenizer
        modules = list(model)
        self._transformer = modules[0].auto_model
        self._after = modules[1:]
        self._padding_idx = _position_padding_idx(self._transformer)

    @staticmethod
    def refusal(model: Any) -> str | None:
        """Why `model`'s pipeline cannot run packed, or None when it can."""
        modules = list(model)
        names = [type(m).__name__ for m in modules]
        if len(names) < 2 or names[0] != "Transformer" or names[1] != "Pooling":
            return f"pipeline {names} does not start with Transformer, Pooling"
        if not set(names[2:]) <= _SENTENCE_MODULES:
            return f"pipeline {names} has modules that read token embeddings after Pooling"
        transformer = modules[0]
        task = getattr(transformer, "transformer_task", "feature-extraction")
        if task != "feature-extraction":
            return f"the transformer's task is {task}"
        auto_model = transformer.auto_model
        if getattr(auto_model.config, "is_decoder", False):
            return "the model is a decoder"
        if not getattr(auto_model, "is_backend_compatible", lambda: False)():
            return f"{type(auto_model).__name__} does not support transformers' attention interface"
        return None

    @classmethod
    def probe(cls, model: Any, tokenizer: EncoderTokenizer) -> UnpaddedEncoder | None:
        """An UnpaddedEncoder for `model` if its pipeline can run packed and a packed pass
        equals a padded one on a few inputs; else None (the model is left as it was)."""
        reason = cls.refusal(model)
        if reason is None:
            items = tokenizer.encode(list(_PROBE_TEXTS))
            device = next(model.parameters()).device
            with torch.inference_mode():
                padded = padded_embed(model, tokenizer, items, device).float()
                unpadded = cls(model, tokenizer)
                reason = _keep_packed_if_equal(
                    model[0].auto_model,
                    lambda: _cosine_mismatch(padded, unpadded.embed(items, device).float()),
                )
            if reason is None:
                return unpadded
        log.info("embedder runs padded batches: %s", reason)
        return None

    def embed(self, items: Sequence[Encoded], device: torch.device | str) -> torch.Tensor:
        """(n, dim) sentence embeddings of `items`, one packed forward pass."""
        hidden, bounds = _packed_forward(
            self._transformer, self.tokenizer, self._padding_idx, items, device
        )
        ends = [end for _, end in bounds]
        cu = torch.tensor([0, *ends], dtype=torch.int32, device=device)
        features: dict[str, Any] = {"token_embeddings": hidden, "cu_seq_lens_q": cu}
        for module in self._after:
            features = module(features)
        embeddings: torch.Tensor = features["sentence_embedding"]
        return embeddings


class UnpaddedCrossEncoder:
    """Runs a cross-encoder's classifier on packed batches; see the module docstring."""

    def __init__(self, model: Any, tokenizer: EncoderTokenizer) -> None:
        self.tokenizer = tokenizer
        classifier = model[0].auto_model
        self._encoder = classifier.base_model
        self._head = _first_token_head(classifier)
        self._padding_idx = _position_padding_idx(self._encoder)

    @staticmethod
    def refusal(model: Any) -> str | None:
        """Why cross-encoder `model` cannot run packed, or None when it can."""
        names = [type(m).__name__ for m in model]
        if names != ["Transformer"]:
            return f"pipeline {names} is not one Transformer"
        transformer = model[0]
        task = getattr(transformer, "transformer_task", None)
        if task != "sequence-classification":
            return f"the transformer's task is {task}"
        classifier = transformer.auto_model
        if getattr(classifier.config, "is_decoder", False):
            return "the model is a decoder"
        if not getattr(classifier, "is_backend_compatible", lambda: False)():
            return f"{type(classifier).__name__} does not support transformers' attention interface"
        if _first_token_head(classifier) is None:
            return f"no packed head for {type(classifier).__name__} (known: {_KNOWN_HEADS})"
        return None

    @classmethod
    def probe(cls, model: Any, tokenizer: EncoderTokenizer) -> UnpaddedCrossEncoder | None:
        """An UnpaddedCrossEncoder for `model` if it can run packed and packed logits equal
        padded ones on a few pairs; else None (the model is left as it was)."""
        reason = cls.refusal(model)
        if reason is None:
            items = tokenizer.encode([(_PROBE_TEXTS[0], text) for text in _PROBE_TEXTS])
            device = next(model.parameters()).device
            with torch.inference_mode():
                padded = padded_logits(model, tokenizer, items, device).float()
                unpadded = cls(model, tokenizer)
                reason = _keep_packed_if_equal(
                    model[0].auto_model,
                    lambda: _logit_mismatch(padded, unpadded.logits(items, device).float()),
                )
            if reason is None:
                return unpadded
        log.info("reranker runs padded batches: %s", reason)
        return None

    def logits(self, items: Sequence[Encoded], device: torch.device | str) -> torch.Tensor:
        """(n, labels) classifier logits of `items`, one packed forward pass."""
        hidden, bounds = _packed_forward(
            self._encoder, self.tokenizer, self._padding_idx, items, device
        )
        assert self._head is not None  # refusal() rules out models without one
        firsts = torch.tensor([start for start, _ in bounds], device=hidden.device)
        return self._head(hidden[0].index_select(0, firsts))


def _keep_packed_if_equal(auto_model: Any, mismatch: Callable[[], str | None]) -> str | None:
    """Switch `auto_model` to packed attention and run the packed pass in `mismatch`: None
    when it equals the padded one (the packed attention stays), else why not, with the
    model's attention restored."""
    previous = auto_model.config._attn_implementation
    register()
    auto_model.set_attn_implementation(ATTENTION_NAME)
    try:
        reason = mismatch()
        if reason is None:
            return None
    except Exception as e:  # any failure means: stay padded
        reason = f"a packed pass failed: {e}"
    auto_model.set_attn_implementation(previous)
    return reason


def _cosine_mismatch(padded: torch.Tensor, packed: torch.Tensor) -> str | None:
    worst = float(F.cosine_similarity(padded, packed, dim=-1).min())
    if worst >= _PROBE_MIN_COSINE:
        return None
    return f"a packed pass differs from a padded one (cosine {worst:.6f})"


def _logit_mismatch(padded: torch.Tensor, packed: torch.Tensor) -> str | None:
    worst = float((packed - padded).abs().max())
    if worst <= _PROBE_MAX_LOGIT_ERROR * (1 + float(padded.abs().max())):
        return None
    return f"packed logits differ from padded ones (by {worst:.3g})"


def _first_token_head(classifier: Any) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """`classifier`'s head as a function of its inputs' first-token states `(n, hidden)`, for
    the architectures whose head reads only that token; None for others. (Objects, not
    closures: the stages travel to forward worker processes by pickle.)"""
    name = type(classifier).__name__
    if name == "BertForSequenceClassification":
        return None if classifier.bert.pooler is None else _BertHead(classifier)
    if name in ("RobertaForSequenceClassification", "XLMRobertaForSequenceClassification"):
        return _RobertaHead(classifier)
    return None


class _BertHead:
    """BertPooler (dense + tanh on token 0), then dropout (off in eval) and the classifier."""

    def __init__(self, classifier: Any) -> None:
        self.classifier = classifier

    def __call__(self, first: torch.Tensor) -> torch.Tensor:
        c = self.classifier
        out: torch.Tensor = c.classifier(c.dropout(c.bert.pooler(first[:, None])))
        return out


class _RobertaHead:
    """The classification head reads token 0 of its (n, length, hidden) input itself."""

    def __init__(self, classifier: Any) -> None:
        self.classifier = classifier

    def __call__(self, first: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.classifier.classifier(first[:, None])
        return out


_KNOWN_HEADS = ", ".join(
    [
        "BertForSequenceClassification",
        "RobertaForSequenceClassification",
        "XLMRobertaForSequenceClassification",
    ]
)
# Largest packed-vs-padded logit difference the probe accepts, relative to 1 + |logit|.
_PROBE_MAX_LOGIT_ERROR = 1e-4


def _packed_forward(
    encoder: torch.nn.Module,
    tokenizer: EncoderTokenizer,
    padding_idx: int | None,
    items: Sequence[Encoded],
    device: torch.device | str,
) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """`encoder`'s last hidden states `(1, T, hidden)` for `items` packed into one row, and
    each input's `[start, end)` in it."""
    lengths = [len(e.ids) for e in items]
    ends = list(itertools.accumulate(lengths))
    starts = [end - n for end, n in zip(ends, lengths, strict=True)]
    ids = torch.tensor([list(itertools.chain.from_iterable(e.ids for e in items))])
    positions = torch.tensor([[p for e in items for p in _positions(e.ids, padding_idx)]])
    inputs: dict[str, Any] = {"input_ids": ids.to(device), "position_ids": positions.to(device)}
    if tokenizer.uses_types:
        types = [t for e in items for t in (e.type_ids or [0] * len(e.ids))]
        inputs["token_type_ids"] = torch.tensor([types], device=device)
    bounds = list(zip(starts, ends, strict=True))
    hidden: torch.Tensor = encoder(**inputs, hub_bounds=bounds, return_dict=True)[0]
    return hidden, bounds


def padded_logits(
    model: Any, tokenizer: EncoderTokenizer, items: Sequence[Encoded], device: torch.device | str
) -> torch.Tensor:
    """(n, labels) cross-encoder logits of `items`, one padded pass of the whole pipeline."""
    features = {k: v.to(device) for k, v in tokenizer.pad(items).items()}
    logits: torch.Tensor = model(features)["scores"]
    return logits


def padded_embed(
    model: Any, tokenizer: EncoderTokenizer, items: Sequence[Encoded], device: torch.device | str
) -> torch.Tensor:
    """(n, dim) sentence embeddings of `items`, one padded pass of the whole pipeline."""
    features = {k: v.to(device) for k, v in tokenizer.pad(items).items()}
    embeddings: torch.Tensor = model(features)["sentence_embedding"]
    return embeddings


def _position_padding_idx(model: torch.nn.Module) -> int | None:
    """The pad id RoBERTa-family embeddings number positions around, None for models that
    number them 0, 1, 2, ... (BERT)."""
    for module in model.modules():
        padding_idx = getattr(module, "padding_idx", None)
        positions = getattr(module, "position_embeddings", None)
        if isinstance(padding_idx, int) and isinstance(positions, torch.nn.Embedding):
            return padding_idx
    return None


def _positions(ids: Sequence[int], padding_idx: int | None) -> list[int]:
    """One input's position ids, as its model computes them for a padded batch: 0, 1, 2, ...;
    for RoBERTa-family models, padding_idx + 1, + 2, ... counting only tokens that are not
    the pad id, which themselves get padding_idx (a pad token inside a text included)."""
    if padding_idx is None:
        return list(range(len(ids)))
    out, count = [], 0
    for token in ids:
        if token == padding_idx:
            out.append(padding_idx)
        else:
            count += 1
            out.append(padding_idx + count)
    return out
