"""Tokenizing for the encoder backends exactly as sentence-transformers does, but fast.

Contract: `EncoderTokenizer` turns texts, text pairs or token-id lists into `Encoded` inputs
(ids with the model's special tokens, and token types where the model takes them) and pads a
batch of them into the tensors the model's module pipeline expects. The result equals what
`SentenceTransformer.encode` / `CrossEncoder.predict` feed the model: the same tokenizer
(with the normaliser sentence-transformers configured, e.g. lowercasing), the same special
tokens, `longest_first` truncation at the model's maximum length from the tokenizer's
`truncation_side`, padding on its `padding_side`.

It works on a private copy of the Rust tokenizer with padding and truncation switched off, so
lengths are measured before any truncation (needed to refuse over-long inputs when asked) and no
other caller's settings leak in. Token-id inputs are content ids, as
`tokenizer.encode(text, add_special_tokens=False)` gives them; the model's special tokens are
added around them as for text, so `[ids of "hello"]` embeds like `"hello"`.

Encoding is not thread-safe: a backend encodes from its one tokenizer thread only. `pad`
touches no tokenizer state and runs in any number of forward threads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tokenizers import Encoding, Tokenizer

from backends.errors import LoadError
from backends.text_bounds import CharBound


@dataclass(frozen=True, slots=True)
class Encoded:
    """One model input: token ids with special tokens, and their token types if used."""

    ids: list[int]
    type_ids: list[int] | None

    @property
    def length(self) -> int:
        return len(self.ids)


class EncoderTokenizer:
    """Encode and pad for one loaded encoder; `tokenizer` is the model's own (transformers)
    tokenizer after sentence-transformers configured it, `max_length` the model's maximum
    input length, `vocab_size` the rows of its input embedding (token ids must be below)."""

    def __init__(self, tokenizer: Any, *, max_length: int, vocab_size: int) -> None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if not isinstance(backend, Tokenizer):
            raise LoadError(
                f"the encoder backends need a fast (Rust `tokenizers`) tokenizer; "
                f"{type(tokenizer).__name__} has none (add a tokenizer.json to the model folder)"
            )
        self.max_length = max_length
        self.vocab_size = vocab_size
        self.uses_types = "token_type_ids" in getattr(tokenizer, "model_input_names", ())
        self._pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self._pad_left = getattr(tokenizer, "padding_side", "right") == "left"
        side = getattr(tokenizer, "truncation_side", "right")
        self._truncate_left = side == "left"
        self._full = Tokenizer.from_str(backend.to_str())
        self._full.no_padding()
        self._full.no_truncation()
        self._cut = Tokenizer.from_str(backend.to_str())
        self._cut.no_padding()
        self._cut.enable_truncation(max_length, strategy="longest_first", direction=side)
        self._prefix, self._suffix = self._single_template()
        self.char_bound = CharBound.for_vocab(
            max_length, self._full.get_vocab(with_added_tokens=True)
        )

    # ---- encoding --------------------------------------------------------------------------
    def bounded(self, text: str, *, truncate: bool, param: str, what: str) -> str:
        """`text` as it may go to `encode`: whole when its length alone does not prove it
        over `max_length` tokens; else cut (keeping what truncation would keep) when
        `truncate`, refused (InputError naming `param`) when not. Costs no tokenizing."""
        bound = self.char_bound
        if bound.fits(text):
            return text
        if truncate:
            return bound.cut(text, keep_end=self._truncate_left)
        bound.require(text, param, what)
        return text  # not reached: require raised

    def encode(self, inputs: Sequence[str | tuple[str, str]]) -> list[Encoded]:
        """Texts, or (query, document) pairs as cross-encoders take them, with special tokens
        and without truncation: an input may come back longer than `max_length`."""
        return self._wrap(self._full.encode_batch(list(inputs), add_special_tokens=True))

    def encode_truncated(self, inputs: Sequence[str | tuple[str, str]]) -> list[Encoded]:
        """As `encode`, truncated to `max_length` as the model's own tokenizer truncates."""
        return self._wrap(self._cut.encode_batch(list(inputs), add_special_tokens=True))

    def keep_first_tokens(self, texts: Sequence[str], max_tokens: int) -> list[str]:
        """Each text cut after its first `max_tokens` content tokens (special tokens not
        counted), at the character where that token ends; shorter texts come back whole."""
        encodings = self._full.encode_batch(list(texts), add_special_tokens=False)
        return [
            text if len(e.ids) <= max_tokens else text[: e.offsets[max_tokens - 1][1]]
            for text, e in zip(texts, encodings, strict=True)
        ]

    def wrap_ids(self, ids: Sequence[int], *, truncate: bool = False) -> Encoded:
        """Content token ids wrapped in the model's special tokens; with `truncate`, content is
        cut (from the tokenizer's truncation side) to fit `max_length`."""
        content = list(ids)
        room = self.max_length - len(self._prefix) - len(self._suffix)
        if truncate and len(content) > room:
            content = content[len(content) - room :] if self._truncate_left else content[:room]
        full = self._prefix + content + self._suffix
        return Encoded(full, [0] * len(full) if self.uses_types else None)

    def first_invalid_id(self, ids: Sequence[int]) -> int | None:
        """The first id the model has no embedding for, if any."""
        limit = self.vocab_size
        for token in ids:
            if not 0 <= token < limit:
                return token
        return None

    def _wrap(self, encodings: list[Encoding]) -> list[Encoded]:
        if self.uses_types:
            return [Encoded(e.ids, e.type_ids) for e in encodings]
        return [Encoded(e.ids, None) for e in encodings]

    def _single_template(self) -> tuple[list[int], list[int]]:
        """The special tokens the tokenizer puts before and after a single sequence."""
        probe = "hello world"
        plain = self._full.encode(probe, add_special_tokens=False).ids
        full = self._full.encode(probe, add_special_tokens=True)
        mask = full.special_tokens_mask
        start = 0
        while start < len(mask) and mask[start]:
            start += 1
        end = len(mask)
        while end > start and mask[end - 1]:
            end -= 1
        if full.ids[start:end] != plain:
            raise LoadError(
                "this tokenizer's special tokens are not a plain prefix and suffix around the "
                "text, so token-id inputs cannot be wrapped like text"
            )
        return full.ids[:start], full.ids[end:]

    # ---- padding ---------------------------------------------------------------------------
    def pad(self, batch: Sequence[Encoded]) -> dict[str, torch.Tensor]:
        """The batch as padded (n, longest) tensors: input_ids, attention_mask and, when the
        model takes them, token_type_ids."""
        longest = max(len(e.ids) for e in batch)
        ids, mask, types = [], [], []
        for e in batch:
            gap = longest - len(e.ids)
            if self._pad_left:
                ids.append([self._pad_id] * gap + e.ids)
                mask.append([0] * gap + [1] * len(e.ids))
                if e.type_ids is not None:
                    types.append([0] * gap + e.type_ids)
            else:
                ids.append(e.ids + [self._pad_id] * gap)
                mask.append([1] * len(e.ids) + [0] * gap)
                if e.type_ids is not None:
                    types.append(e.type_ids + [0] * gap)
        features = {
            "input_ids": torch.tensor(ids, dtype=torch.long),
            "attention_mask": torch.tensor(mask, dtype=torch.long),
        }
        if self.uses_types:
            features["token_type_ids"] = torch.tensor(types, dtype=torch.long)
        return features
