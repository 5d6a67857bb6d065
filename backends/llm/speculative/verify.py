"""The sampler's rows for a step that verifies drafts: one per position of a draft chunk.

A sequence scheduled with drafts `d_1..d_k` after its last token gets `k + 1` rows, the
logits at its last token and at each draft. Row `j` is sampled as the sequence's next token
would be had it already produced `d_1..d_j` (`DraftPosition` stands for the sequence there:
its output count, which `min_tokens` reads, and its grammar state, which masks the row). The
scheduler keeps the drafts up to the first one the sampled token differs from, then that
sampled token (`Scheduler.update`).

Why this keeps the target's distribution: drafts are point masses (prompt lookup copies
tokens, a draft model proposes its argmax), and for a point mass `q = [x]` the standard rule
(accept with probability min(1, p(x) / q(x)) = p(x), else sample from norm(max(0, p - q)),
which is p without x) is exactly "sample y from p; accept x if y == x, else emit y". Greedy
rows take the argmax, so greedy output is the target's token for token.
"""

from __future__ import annotations

from typing import Any

from backends.llm.sampling_params import SamplingParams
from backends.llm.scheduler import ScheduledSequence
from backends.llm.sequence import Sequence
from backends.llm.structured.guide import TokenGuide


class DraftPosition:
    """A sequence as the sampler sees it after `offset` of its drafts (read-only)."""

    __slots__ = ("guide", "index", "num_output_tokens", "params", "seq_id")

    def __init__(self, seq: Sequence, offset: int, guide: TokenGuide | None) -> None:
        self.seq_id = seq.seq_id
        self.index = seq.index
        self.params: SamplingParams = seq.params
        self.num_output_tokens = seq.num_output_tokens + offset
        self.guide = guide


def sampling_rows(scheduled: list[ScheduledSequence]) -> list[Any]:
    """The sampler's row objects for a step, in row order: the sequence itself for an entry
    without drafts, its `DraftPosition`s for one with drafts."""
    rows: list[Any] = []
    for item in scheduled:
        if not item.sample:
            continue
        if not item.drafts:
            rows.append(item.seq)
            continue
        seq = item.seq
        rows.append(seq)
        for j in range(1, len(item.drafts) + 1):
            rows.append(DraftPosition(seq, j, _guide_after(seq.guide, item.drafts[:j])))
    return rows


def _guide_after(guide: TokenGuide | None, drafts: tuple[int, ...]) -> TokenGuide | None:
    """A copy of `guide` advanced over `drafts` (which the speculator checked it allows)."""
    if guide is None:
        return None
    matcher = guide.matcher.deep_copy()
    matcher.consume_tokens(list(drafts))
    return TokenGuide(matcher, guide.vocab_size)
