"""Text a tokenizer can take: valid Unicode with no lone UTF-16 surrogates.

JSON may carry `"\\ud800"` (a surrogate with no partner); Python decodes it into a `str` that no
UTF-8 encoder accepts, and the Rust tokenizers then fail with an error that says nothing of
the input (and, in a batch, fails every request tokenized with it). `require_encodable` turns
such text into the caller's 400, naming the field, before it reaches a tokenizer.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from backends.errors import InputError

_SURROGATE = re.compile("[\ud800-\udfff]")


def require_encodable(texts: str | Iterable[object], param: str) -> None:
    """Raise InputError naming `param` when a text (strings among `texts`) holds a lone
    surrogate; anything that is not a string is left to its own checks."""
    items = [texts] if isinstance(texts, str) else texts
    for i, text in enumerate(items):
        if not isinstance(text, str) or text.isascii():
            continue
        match = _SURROGATE.search(text)
        if match is not None:
            where = param if isinstance(texts, str) else f"{param}[{i}]"
            raise InputError(
                f"{where} holds an unpaired UTF-16 surrogate (U+{ord(match.group()):04X}) at "
                f"character {match.start()}; send valid Unicode text",
                param=param,
            )
