"""Which sequences propose drafts this step, and how many tokens each.

`Speculator.propose(running)` runs just before the scheduler: it sets `draft_token_ids` on
the decoding sequences that should speculate (the scheduler trims them to what fits). A
sequence does not speculate when its request opted out (`SamplingParams.speculative`), when
its sampling keeps per-token state that drafts would advance (a seed, penalties), before its
`min_tokens` are out, once its drafts have proved useless (after `min_proposed` proposed
tokens, an accepted share below `min_acceptance`), or in a step with more decoding sequences
than `max_batch`, where the step is bound by compute and verifying drafts costs more than it
saves. A structured request's drafts are cut at the first one its grammar refuses.

Below `max_batch`, speculation is also turned down by its cost (`cost.SpeculationCost`): the
engine reports each step (`observe`), and no sequence proposes in a step where the tokens the
step's sequences are expected to emit with drafts (each one's moving average over its recent
verify steps) do not exceed what a step with drafts costs over one without at that batch size.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

from backends.llm.scheduler import SchedulerOutput
from backends.llm.sequence import Sequence
from backends.llm.speculative.cost import SpeculationCost
from backends.llm.speculative.ngram import propose_ngram
from backends.runtime_config import SpeculativeConfig

# Weight of a verify step's tokens in its sequence's moving average of them (which starts at
# the most a step can give, k + 1, so that a new sequence gets measured).
YIELD_WEIGHT = 0.3
# Each step a sequence does not speculate, its average moves this share of the way back to
# k + 1: a sequence whose drafts stopped landing tries again now and then (a miss costs one
# verify step's extra; a copy found late costs k tokens a step). Against the drop a miss
# makes, that retries in about one step in ten where a step with drafts costs 1.5 plain ones,
# and more often where it costs less.
YIELD_RECOVERY = 0.005
# A gap after a step longer than this many times the step is the engine idle, not part of
# the step's cost.
IDLE_FACTOR = 4.0


class Proposer(Protocol):
    """Makes drafts: prompt lookup, or a draft model with state per sequence."""

    def propose(self, seqs: list[Sequence], num_tokens: int) -> list[list[int]]:
        """Up to `num_tokens` drafts for each of `seqs` (one list each, maybe empty)."""
        ...

    def keep_only(self, seq_ids: set[int]) -> None:
        """Drop any state kept for sequences other than these (the running ones)."""
        ...


class PromptLookup:
    """Drafts copied from the sequence's own tokens (`ngram`); keeps no state."""

    def __init__(self, min_match: int, max_match: int) -> None:
        self.min_match = min_match
        self.max_match = max_match

    def propose(self, seqs: list[Sequence], num_tokens: int) -> list[list[int]]:
        return [
            propose_ngram(s.token_ids, num_tokens, self.min_match, self.max_match) for s in seqs
        ]

    def keep_only(self, seq_ids: set[int]) -> None:
        return None


class Speculator:
    """Sets a step's drafts; `proposer` makes them (prompt lookup when None)."""

    def __init__(
        self,
        config: SpeculativeConfig,
        proposer: Proposer | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.config = config
        self.proposer = proposer or PromptLookup(config.min_match, config.max_match)
        self.cost = SpeculationCost()
        self.clock = clock
        self._started: float | None = None
        self._speculated = False
        # The last decode-only step, timed up to the next step's start (so that what the
        # engine does per step outside it, streaming the outputs, counts too): (batch,
        # speculated, started, ended).
        self._pending: tuple[int, bool, float, float] | None = None
        # Per sequence: a moving average of the tokens its verify steps emitted.
        self._yield: dict[int, float] = {}

    def propose(self, running: list[Sequence]) -> int:
        """Draft for the decoding sequences of `running` that should speculate; returns the
        number of tokens proposed. Called as a step starts (the step's time counts from
        here to `observe`)."""
        self._started = now = self.clock()
        self._speculated = False
        if self._pending is not None:
            batch, speculated, started, ended = self._pending
            self._pending = None
            # A long gap is the engine waiting for work, not the step's: its own time then.
            gap = now - ended
            until = now if gap <= IDLE_FACTOR * (ended - started) else ended
            self.cost.observe(batch, speculated, until - started)
        running_ids = {s.seq_id for s in running}
        self.proposer.keep_only(running_ids)
        if len(self._yield) > len(running_ids):
            self._yield = {i: y for i, y in self._yield.items() if i in running_ids}
        decoding = [s for s in running if s.num_tokens - s.num_computed_tokens == 1]
        if not decoding or len(decoding) > self.config.max_batch:
            return 0
        chosen = [s for s in decoding if self.wants(s)]
        if not chosen:
            return 0
        # A sequence not measured yet is expected to yield everything (so it gets measured).
        most = self.config.num_tokens + 1.0
        expected = sum(self._yield.get(s.seq_id, most) for s in chosen)
        expected += len(decoding) - len(chosen)
        if not self.cost.speculate(len(decoding), expected / len(decoding)):
            for s in chosen:
                y = self._yield.get(s.seq_id)
                if y is not None:
                    self._yield[s.seq_id] = y + YIELD_RECOVERY * (most - y)
            return 0
        proposed = 0
        self._speculated = True  # the step's cost is speculation's, drafts or none
        drafted = self.proposer.propose(chosen, self.config.num_tokens)
        for seq, drafts in zip(chosen, drafted, strict=True):
            if drafts and seq.guide is not None:
                drafts = drafts[: seq.guide.matcher.validate_tokens(drafts)]
            seq.draft_token_ids = drafts
            proposed += len(drafts)
        return proposed

    def observe(self, output: SchedulerOutput, emitted: list[tuple[Sequence, list[int]]]) -> None:
        """The step `propose` started ran `output`, and `emitted` says how many tokens (rows)
        each sequence got: each verifying sequence's yield is updated, and a step of decodes
        only counts toward the cost of speculating (a step whose proposer ran, drafts or
        none) or of not speculating, timed from its start to the next step's (`propose`)."""
        started, self._started = self._started, None
        items = output.scheduled
        if any(item.drafts for item in items):
            verified = {item.seq.seq_id for item in items if item.drafts}
            most = self.config.num_tokens + 1.0
            for seq, rows in emitted:
                if seq.seq_id in verified:
                    before = self._yield.get(seq.seq_id, most)
                    self._yield[seq.seq_id] = before + YIELD_WEIGHT * (len(rows) - before)
        if started is None or not items:
            return
        if any(not item.sample or item.num_tokens != 1 + len(item.drafts) for item in items):
            return  # a prompt chunk in the step: its time is no decode's
        self._pending = (len(items), self._speculated, started, self.clock())

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
