"""Prompt lookup: drafts copied from the sequence's own tokens. Pure Python.

A sequence that repeats itself (code being rewritten, a document quoted back, a loop) has
its next tokens written earlier in its context. The last `n` tokens (`max_match` down to
`min_match`) are searched for earlier in the prompt and output; the tokens that followed the
most recent earlier occurrence are the proposal. Where they run into the end of the context
the copy goes on over the tokens it has just proposed (an overlapping copy, as in LZ77), so a
loop of period p is continued for all `num_tokens`.
"""

from __future__ import annotations


def propose_ngram(tokens: list[int], num_tokens: int, min_match: int, max_match: int) -> list[int]:
    """Up to `num_tokens` tokens that followed the latest earlier occurrence of the longest
    suffix of `tokens` (between `min_match` and `max_match` long) found; [] when none is."""
    length = len(tokens)
    for n in range(min(max_match, length - 1), min_match - 1, -1):
        suffix = tokens[length - n :]
        first = suffix[0]
        # Latest start first; the occurrence must end before the suffix itself does.
        for start in range(length - n - 1, -1, -1):
            if tokens[start] == first and tokens[start : start + n] == suffix:
                follow = start + n
                out = tokens[follow : follow + num_tokens]
                while len(out) < num_tokens:  # overlapping copy: the loop goes on
                    index = follow + len(out) - length
                    out.append(out[index])
                return out
    return []
