"""Tiny BERT encoders with random weights: a sentence embedder and a cross-encoder reranker.

Contract: `build_tiny_embedder(out_dir)` writes a complete sentence-transformers folder
(modules.json, config_sentence_transformers.json, sentence_bert_config.json, the BERT weights
and tokenizer, 1_Pooling with mean pooling and, when `normalize`, 2_Normalize) that
`SentenceTransformer(str(out_dir), device="cpu")` loads offline; `encode` gives
`hidden_size`-dimensional vectors, of unit length when `normalize`. `build_tiny_reranker(out_dir)`
writes a `BertForSequenceClassification` with one label and its tokenizer, the layout of
real rerankers (`architecture="roberta"`: a `RobertaForSequenceClassification`, the family
of BGE's XLM-RoBERTa rerankers, with the same tokenizer), that `CrossEncoder(str(out_dir),
device="cpu")` loads offline; `predict` gives one score per (query, document) pair. Both use
the WordPiece vocabulary of `backends.tiny.tokenizer`, save safetensors only, and depend on
`seed` alone.

Weights are drawn wider than BERT's own initialisation (`initializer_range` 0.2) so that
different texts get clearly different embeddings and scores.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    BertModel,
    BertTokenizer,
    RobertaConfig,
    RobertaForSequenceClassification,
)

from backends.tiny.tokenizer import build_wordpiece_vocab

INITIALIZER_RANGE = 0.2
ENCODER_VOCAB_SIZE = 512
# BERT's own position table; longer when a caller asks for longer sequences.
_BERT_MAX_POSITIONS = 512


def build_tiny_embedder(
    out_dir: Path,
    *,
    hidden_size: int = 32,
    num_layers: int = 2,
    seed: int = 0,
    normalize: bool = True,
    max_seq_length: int = 128,
) -> Path:
    """Build a random mean-pooling sentence embedder of `hidden_size` dimensions into `out_dir`."""
    out_dir = Path(out_dir)
    config = _bert_config(hidden_size, num_layers, max_seq_length)
    torch.manual_seed(seed)
    model = BertModel(config)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    _tokenizer(max_seq_length).save_pretrained(out_dir)
    _write_sentence_transformers_layout(out_dir, hidden_size, normalize, max_seq_length)
    return out_dir


def _write_sentence_transformers_layout(
    out_dir: Path, hidden_size: int, normalize: bool, max_seq_length: int
) -> None:
    """The module files around the BERT weights, in the classic layout of real checkpoints.

    Written by hand rather than by `SentenceTransformer.save`: the files then look like those of
    the published models (all-MiniLM-L6-v2 and the like) that the hub serves in practice, and
    older sentence-transformers releases read them as well as the current one.
    """
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    if normalize:
        modules.append(
            {
                "idx": 2,
                "name": "2",
                "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize",
            }
        )
    pooling = {
        "word_embedding_dimension": hidden_size,
        "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": True,
        "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False,
        "pooling_mode_weightedmean_tokens": False,
        "pooling_mode_lasttoken": False,
        "include_prompt": True,
    }
    files: dict[str, object] = {
        "modules.json": modules,
        "sentence_bert_config.json": {"max_seq_length": max_seq_length, "do_lower_case": False},
        "config_sentence_transformers.json": {
            "prompts": {},
            "default_prompt_name": None,
            "similarity_fn_name": "cosine",
        },
        "1_Pooling/config.json": pooling,
    }
    for name, content in files.items():
        path = out_dir / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(content, indent=2) + "\n")
    if normalize:
        (out_dir / "2_Normalize").mkdir(exist_ok=True)


def build_tiny_reranker(
    out_dir: Path,
    *,
    hidden_size: int = 32,
    num_layers: int = 2,
    seed: int = 0,
    max_length: int = 128,
    architecture: str = "bert",
) -> Path:
    """Build a random one-label cross-encoder (`architecture` "bert" or "roberta") with its
    tokenizer into `out_dir`."""
    out_dir = Path(out_dir)
    config = _bert_config(hidden_size, num_layers, max_length)
    config.num_labels = 1
    torch.manual_seed(seed)
    model: BertForSequenceClassification | RobertaForSequenceClassification
    if architecture == "bert":
        model = BertForSequenceClassification(config)
    elif architecture == "roberta":
        # RoBERTa numbers positions from pad_token_id + 1, so its table is that much longer;
        # the pad id is the tokenizer's (0) so padded batches mask what the tokenizer pads.
        fields = config.to_dict()
        fields["max_position_embeddings"] = config.max_position_embeddings + 2
        roberta = RobertaConfig(**{k: v for k, v in fields.items() if k != "model_type"})
        model = RobertaForSequenceClassification(roberta)
    else:
        raise ValueError(f"architecture={architecture!r}: expected 'bert' or 'roberta'")
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    _tokenizer(max_length).save_pretrained(out_dir)
    return out_dir


def _bert_config(hidden_size: int, num_layers: int, max_length: int) -> BertConfig:
    # Heads of 16 dimensions, as small BERTs use (MiniLM: 384 wide, 12 heads of 32).
    num_heads = max(1, hidden_size // 16)
    if hidden_size % num_heads != 0:
        raise ValueError(f"hidden_size={hidden_size} must be a multiple of 16 (or below 16)")
    return BertConfig(
        vocab_size=ENCODER_VOCAB_SIZE,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        intermediate_size=4 * hidden_size,
        max_position_embeddings=max(_BERT_MAX_POSITIONS, max_length),
        initializer_range=INITIALIZER_RANGE,
        pad_token_id=0,
    )


def _tokenizer(max_length: int) -> BertTokenizer:
    vocab = build_wordpiece_vocab(vocab_size=ENCODER_VOCAB_SIZE)
    return BertTokenizer(vocab=vocab, do_lower_case=True, model_max_length=max_length)
