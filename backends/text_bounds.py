"""A text's length in characters, checked before it is tokenized.

Tokenizing costs CPU in proportion to the text (a prompt of a few MiB takes seconds of a
tokenizer thread, only for the engine to refuse it as too long). No token of a vocabulary spans more
characters than its longest entry, so a text of more than `max_tokens * chars_per_token`
characters needs more than `max_tokens` tokens: it can be refused (or cut, where the caller
asked for truncation) from its length alone, in microseconds.

The bound is exact for what a tokenizer keeps. A tokenizer that drops characters (BERT's
pre-tokenizer drops whitespace, an accent-stripping normaliser drops combining marks) can
turn a longer text into fewer tokens; a text made mostly of what its tokenizer drops is
refused or cut by this bound though it would have fit. That is the price of never
tokenizing a text known to be hopeless, and such a text means nothing to the model anyway.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from backends.errors import InputError

# A floor under the vocabulary's own figure: generous for small or odd vocabularies (a
# tokenizer built on the spot has no long entries), still refusing a megabyte prompt at once.
MIN_CHARS_PER_TOKEN = 16


@dataclass(frozen=True)
class CharBound:
    """`max_tokens` tokens span at most `max_chars` characters (`max_tokens` times the
    characters of the vocabulary's longest entry, at least MIN_CHARS_PER_TOKEN)."""

    max_tokens: int
    chars_per_token: int

    @classmethod
    def for_vocab(cls, max_tokens: int, vocab: Iterable[str]) -> CharBound:
        """The bound for a vocabulary's entries as the tokenizer lists them: byte-level BPE
        lists one character per byte and WordPiece adds `##`, so an entry's length is at
        least the characters its token stands for."""
        longest = max((len(entry) for entry in vocab), default=0)
        return cls(max_tokens, max(longest, MIN_CHARS_PER_TOKEN))

    @property
    def max_chars(self) -> int:
        return self.max_tokens * self.chars_per_token

    def fits(self, text: str) -> bool:
        """False when `text` surely needs more than `max_tokens` tokens."""
        return len(text) <= self.max_chars

    def require(
        self, text: str, param: str, what: str, *, error: type[InputError] = InputError
    ) -> None:
        """Raise `error` (an InputError) naming `param` when `text` (called `what` in the
        message) surely needs more than `max_tokens` tokens."""
        if not self.fits(text):
            raise error(
                f"{what} has {len(text):,} characters; no token of this model's vocabulary "
                f"spans more than {self.chars_per_token}, so it needs more than the "
                f"{self.max_tokens:,} tokens the model takes; shorten it",
                param=param,
            )

    def cut(self, text: str, *, keep_end: bool = False) -> str:
        """`text` shortened to what truncation at `max_tokens` tokens could keep, with as
        many characters again as slack, so that the word the cut falls in (and its
        tokens) lies past the kept tokens; `keep_end` for tokenizers that truncate on the
        left. A text within the bound comes back whole."""
        keep = 2 * self.max_chars
        if len(text) <= keep:
            return text
        return text[-keep:] if keep_end else text[:keep]
