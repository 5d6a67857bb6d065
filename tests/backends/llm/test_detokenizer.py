"""Incremental detokenization: deltas add up to the full decode, characters split across
tokens never come out broken, stop strings spanning tokens are caught and not leaked."""

from __future__ import annotations

from typing import Any

import pytest

from backends.llm.detokenizer import IncrementalDetokenizer, token_bytes
from backends.tiny import build_tokenizer

TEXT = "The harbour town 日本語 woke 🙂 slowly; héllo wörld! 👩‍👩‍👧 end"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


def stream(tokenizer: Any, ids: list[int], **kwargs: Any) -> tuple[list[str], str | None]:
    prompt = tokenizer.encode("Once upon a time")
    detok = IncrementalDetokenizer(tokenizer, prompt, **kwargs)
    deltas = []
    for token in ids:
        delta, stop = detok.push([token])
        deltas.append(delta)
        if stop is not None:
            deltas.append(detok.flush())
            return deltas, stop
    deltas.append(detok.flush())
    return deltas, None


def test_deltas_add_up_to_the_full_text_and_never_split_a_character(tokenizer: Any) -> None:
    ids = tokenizer.encode(TEXT)
    assert len(ids) > len(TEXT) // 3  # multi-byte characters take several byte-level tokens
    deltas, stop = stream(tokenizer, ids)
    assert "".join(deltas) == tokenizer.decode(ids) == TEXT
    assert stop is None
    assert not any("\ufffd" in d for d in deltas)


def test_a_stop_string_spanning_tokens_ends_the_text_before_it(tokenizer: Any) -> None:
    ids = tokenizer.encode(TEXT)
    deltas, stop = stream(tokenizer, ids, stop=("woke 🙂 sl",))
    assert stop == "woke 🙂 sl"
    assert "".join(deltas) == "The harbour town 日本語 "
    assert not any("wo" in d for d in deltas), "no part of the stop string leaks out"


def test_the_stop_string_is_kept_when_asked(tokenizer: Any) -> None:
    ids = tokenizer.encode(TEXT)
    deltas, stop = stream(tokenizer, ids, stop=("héllo",), include_stop_str_in_output=True)
    assert stop == "héllo"
    assert "".join(deltas) == TEXT[: TEXT.index("héllo") + len("héllo")]


def test_earliest_of_several_stop_strings_wins(tokenizer: Any) -> None:
    ids = tokenizer.encode(TEXT)
    deltas, stop = stream(tokenizer, ids, stop=("slowly", "town"))
    assert stop == "town"
    assert "".join(deltas) == "The harbour "


def test_text_held_back_for_a_stop_string_that_never_completes_is_flushed(tokenizer: Any) -> None:
    ids = tokenizer.encode("ends with en")
    deltas, stop = stream(tokenizer, ids, stop=("end of story",))
    assert stop is None
    assert deltas[-1].endswith("en"), "the possible start of a stop string waited for the end"
    assert "".join(deltas) == "ends with en"


def test_special_tokens_are_skipped_unless_asked(tokenizer: Any) -> None:
    ids = [*tokenizer.encode("hi"), tokenizer.eos_token_id]
    assert "".join(stream(tokenizer, ids)[0]) == "hi"
    kept = "".join(stream(tokenizer, ids, skip_special_tokens=False)[0])
    assert kept == "hi" + tokenizer.eos_token


def test_a_character_cut_by_the_end_is_held_until_the_flush(tokenizer: Any) -> None:
    """Only an output that really ends inside a character (max_tokens mid-way) shows
    U+FFFD, once, at the flush: exactly what decoding all its ids at once gives."""
    ids = tokenizer.encode("ab 🙂")
    assert len(ids) >= 4 + 2  # the emoji is four byte tokens
    deltas, _ = stream(tokenizer, ids[:-2])
    assert deltas[-1] == "\ufffd" and not any("\ufffd" in d for d in deltas[:-1])
    assert "".join(deltas) == tokenizer.decode(ids[:-2]) == "ab \ufffd"


def test_token_bytes_are_the_tokens_own_and_join_into_characters(tokenizer: Any) -> None:
    ids = tokenizer.encode(TEXT)
    assert b"".join(token_bytes(tokenizer, i) for i in ids) == TEXT.encode()
    assert token_bytes(tokenizer, tokenizer.encode("é")[0]) == "é".encode()[:1]
