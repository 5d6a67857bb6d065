"""Which sequences propose drafts this step, and how many tokens each.

`Speculator.propose(running)` runs just before the scheduler: it sets `draft_token_ids` on
the decoding sequences that should speculate (the scheduler trims them to what fits). A
sequence does not speculate when its request opted out (`SamplingParams.speculative`), when
its sampling keeps per-token state that drafts would advance (a seed, penalties), before its
`min_tokens` are out, once its drafts have proved useless (after `min_proposed` proposed
tokens, an accepted share below `min_acceptance`), or in a step with more decoding sequences
than `max_batch`, where the step is bound by compute and verifying drafts costs more than it
saves. A structured request's drafts are cut at the first one its grammar refuses.
"""

from __future__ import annotations

from collections.abc import Callable

from backends.llm.sequence import Sequence
from backends.llm.speculative.ngram import propose_ngram
from backends.runtime_config import SpeculativeConfig

# Drafts for a batch of sequences, `k` tokens at most each: one list per sequence.
Proposer = Callable[[list[Sequence], int], list[list[int]]]


class Speculator:
    """Sets a step's drafts; `proposer` makes them (prompt lookup when None)."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer | None = None) -> None:
        self.config = config
        self.proposer = proposer or self._lookup

    def propose(self, running: list[Sequence]) -> int:
        """Draft for the decoding sequences of `running` that should speculate; returns the
        number of tokens proposed."""
        decoding = [s for s in running if s.num_tokens - s.num_computed_tokens == 1]
        if not decoding or len(decoding) > self.config.max_batch:
            return 0
        chosen = [s for s in decoding if self.wants(s)]
        if not chosen:
            return 0
        proposed = 0
        for seq, drafts in zip(chosen, self.proposer(chosen, self.config.num_tokens), strict=True):
            if drafts and seq.guide is not None:
                drafts = drafts[: seq.guide.matcher.validate_tokens(drafts)]
            seq.draft_token_ids = drafts
            proposed += len(drafts)
        return proposed

    def wants(self, seq: Sequence) -> bool:
        """Whether `seq` should propose drafts now (see the module docstring)."""
        params = seq.params
        if not params.speculative or params.seed is not None or params.needs_penalties:
            return False
        if seq.num_output_tokens < params.min_tokens:
            return False
        if seq.max_tokens - seq.num_output_tokens < 2:
            return False  # room for the target's own token only
        config = self.config
        if seq.spec_proposed >= config.min_proposed:
            return seq.spec_accepted >= config.min_acceptance * seq.spec_proposed
        return True

    def _lookup(self, seqs: list[Sequence], k: int) -> list[list[int]]:
        c = self.config
        return [propose_ngram(s.token_ids, k, c.min_match, c.max_match) for s in seqs]
