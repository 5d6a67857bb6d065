"""Tokens to text as they are generated, and stop strings.

Decoding token by token is wrong for byte-level tokenizers: one character can span tokens,
and a token's text can depend on the token before it. `IncrementalDetokenizer` decodes a
short window instead: the text of `ids[prefix:]` minus the text of `ids[prefix:read]`,
emitted only once it no longer ends in an incomplete character (U+FFFD), after which the
window slides forward. So the concatenated deltas equal decoding all output ids at once.

Stop strings may span tokens too. The detokenizer keeps the whole output text, looks for a
stop string in the part that the new text could have completed, and holds back any tail
that could still become one, so a stop string never leaks into a streamed delta. On a match
the text ends before the stop string (or after it with `include_stop_str_in_output`).
"""

from __future__ import annotations

import functools
import re
from typing import Any

# Context tokens decoded before the new ones, so the first output token gets its spacing.
_CONTEXT_TOKENS = 5
_INCOMPLETE = "\ufffd"
# SentencePiece's byte-fallback tokens.
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def token_bytes(tokenizer: Any, token_id: int) -> bytes:
    """One token's own UTF-8 bytes, possibly part of a character: what OpenAI's logprobs
    `bytes` carries so that a client can join a character's tokens back together (the token
    decoded alone reads U+FFFD there)."""
    text: str = tokenizer.decode([token_id])
    if _INCOMPLETE not in text:
        return text.encode()
    token = tokenizer.convert_ids_to_tokens(token_id)
    if isinstance(token, str) and token:
        if match := _BYTE_TOKEN.fullmatch(token):
            return bytes([int(match.group(1), 16)])
        byte_of = _byte_level_alphabet()
        if all(c in byte_of for c in token):
            return bytes(byte_of[c] for c in token)
    return text.encode()


@functools.cache
def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE (GPT-2, Llama 3, Qwen): the character that stands for each byte."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}


class IncrementalDetokenizer:
    """One sequence's text so far. `push(ids)` returns the new, final text and, when a stop
    string matched, that stop string (the caller then finishes the sequence)."""

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        *,
        stop: tuple[str, ...] = (),
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix = 0
        self._read = len(self._ids)
        self._stop = stop
        self._include_stop = include_stop_str_in_output
        self._skip_special = skip_special_tokens
        self._longest_stop = max((len(s) for s in stop), default=0)
        self.text = ""
        self._emitted = 0

    def push(self, token_ids: list[int]) -> tuple[str, str | None]:
        self._ids.extend(token_ids)
        before = len(self.text)
        self.text += self._decode_new()
        if self._stop:
            matched = self._find_stop(before)
            if matched is not None:
                return self._take(len(self.text)), matched
            return self._take(len(self.text) - self._held_back()), None
        return self._take(len(self.text)), None

    def flush(self) -> str:
        """At the end: the text held back for a stop string that never came, and the bytes
        of a character the output left incomplete (as U+FFFD)."""
        self.text += self._decode_new(final=True)
        return self._take(len(self.text))

    def _decode_new(self, *, final: bool = False) -> str:
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        if len(new_text) <= len(prefix_text) or (new_text.endswith(_INCOMPLETE) and not final):
            return ""  # an incomplete character: wait for the next token
        self._prefix, self._read = self._read, len(self._ids)
        # Keep the window short: the ids before `prefix` are never decoded again.
        if self._prefix > _CONTEXT_TOKENS:
            drop = self._prefix - _CONTEXT_TOKENS
            del self._ids[:drop]
            self._prefix -= drop
            self._read -= drop
        return new_text[len(prefix_text) :]

    def _decode(self, ids: list[int]) -> str:
        text: str = self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)
        return text

    def _find_stop(self, before: int) -> str | None:
        # A match must end inside the new text, so it starts after `before - longest + 1`.
        window_start = max(0, before - self._longest_stop + 1)
        best: tuple[int, str] | None = None
        for stop in self._stop:
            at = self.text.find(stop, window_start)
            if at != -1 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return None
        at, stop = best
        self.text = self.text[: at + len(stop)] if self._include_stop else self.text[:at]
        return stop

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        tail = 0
        for stop in self._stop:
            for k in range(min(len(stop) - 1, len(self.text)), tail, -1):
                if self.text.endswith(stop[:k]):
                    tail = k
                    break
        return tail

    def _take(self, upto: int) -> str:
        upto = max(upto, self._emitted)
        delta = self.text[self._emitted : upto]
        self._emitted = upto
        return delta
