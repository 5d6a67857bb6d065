"""The length bound checked before tokenizing: derived from the vocabulary's longest entry,
refusing with a message naming the field, cutting from the side the tokenizer truncates."""

from __future__ import annotations

import pytest

from backends.errors import InputError
from backends.text_bounds import MIN_CHARS_PER_TOKEN, CharBound

pytestmark = pytest.mark.pure


def test_the_longest_vocabulary_entry_sets_the_characters_per_token() -> None:
    vocab = ["a", "Ġthe", "=" * 40, "<|endoftext|>"]
    assert CharBound.for_vocab(100, vocab) == CharBound(100, 40)
    assert CharBound.for_vocab(100, ["a", "bc"]).chars_per_token == MIN_CHARS_PER_TOKEN


def test_a_text_over_the_bound_is_refused_naming_the_field() -> None:
    bound = CharBound(10, 16)
    bound.require("x" * 160, "prompt", "prompt")  # 160 characters may be 10 tokens
    with pytest.raises(InputError) as e:
        bound.require("x" * 161, "prompt", "prompt")
    assert e.value.param == "prompt"
    assert "161 characters" in str(e.value) and "10 tokens" in str(e.value)


def test_a_cut_keeps_twice_the_bound_from_the_truncated_side() -> None:
    bound = CharBound(10, 16)
    text = "a" * 200 + "b" * 200
    assert bound.cut("short") == "short"
    assert bound.cut(text) == "a" * 200 + "b" * 120
    assert bound.cut(text, keep_end=True) == "a" * 120 + "b" * 200
