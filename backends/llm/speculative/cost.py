"""Whether speculation pays in a step: the tokens drafts are expected to add against what a
step with drafts costs more than one without.

Acceptance alone does not say whether drafts pay: a verify step costs more than a plain one
(more rows, the proposer's own work), and how much more depends on the model, the machine and
the batch (a step bound by streaming weights verifies a few drafts nearly for free, one bound
by compute pays for every row). So two things are measured apart:

- the cost: the engine's decode-only steps are timed in two windows per batch-size bucket
  (1, 2, 3-4, 5-8, ...), steps that verified drafts and steps that did not, each step as
  seconds per sequence; their medians' ratio is what a step with drafts costs relative to a
  plain one at that batch size (a median, so a step the OS delayed does not decide);
- the yield: per sequence, a moving average of the tokens its verify steps emitted (the
  `Speculator` keeps it), which follows what the sequence is writing now.

A step speculates when the tokens per sequence it is expected to emit exceed that cost
ratio by `MARGIN`. Both windows are kept measured (`backends.llm.two_sided`): a bucket's
first steps run plain until `MIN_SAMPLES` are in, then speculate until as many are; after
that one step in `PROBE_EVERY` takes the choice not currently made, so a change of load or
of text turns speculation back on (or off).
"""

from __future__ import annotations

import statistics

from backends.llm.two_sided import TwoSided

# Recent steps kept per bucket and side.
WINDOW = 16
# Steps measured on each side before the costs are compared.
MIN_SAMPLES = 3
# One step in this many (per bucket) takes the other side, to keep it measured.
PROBE_EVERY = 32
# Expected tokens must beat the cost ratio by this factor: the yields are optimistic (they
# start at k + 1 and drift back there while a sequence does not speculate), and a step that
# only breaks even is not worth its variance.
MARGIN = 1.1


def _ratio(plain: float, drafts: float) -> float:
    """Seconds of a step with drafts over one without."""
    return drafts / max(plain, 1e-12)


class SpeculationCost:
    """What a step with drafts costs against one without, by batch size; `speculate` says
    whether a step should propose, `observe` records a step."""

    def __init__(self, *, by_cost: bool = True) -> None:
        """`by_cost` False: every step speculates (tests of what drafts do, not of when)."""
        self.by_cost = by_cost
        # Per batch-size bucket, seconds per sequence of recent decode steps: side A
        # without drafts, side B with.
        self._sides: TwoSided[int] = TwoSided(
            window=WINDOW,
            min_samples=MIN_SAMPLES,
            score=statistics.median,
            probe_a_every=PROBE_EVERY,
            probe_b_every=PROBE_EVERY,
        )

    @staticmethod
    def bucket_of(batch: int) -> int:
        """1, 2, 3-4, 5-8, ... share a bucket (the exponent of its largest power of two)."""
        return (batch - 1).bit_length()

    def speculate(self, batch: int, expected_tokens: float) -> bool:
        """Whether a step of `batch` decoding sequences should propose drafts, when with
        drafts it is expected to emit `expected_tokens` per sequence (1 without)."""
        if not self.by_cost:
            return True

        def pays(plain: float, drafts: float) -> bool:
            return expected_tokens > MARGIN * _ratio(plain, drafts)

        return self._sides.choose(self.bucket_of(batch), pays)

    def cost_ratio(self, batch: int) -> float | None:
        """Recent seconds of a step with drafts over one without at this batch size (per
        sequence, medians); None until both were measured."""
        key = self.bucket_of(batch)
        plain, drafts = self._sides.score(key, False), self._sides.score(key, True)
        if plain is None or drafts is None:
            return None
        return _ratio(plain, drafts)

    def observe(self, batch: int, drafts: bool, seconds: float) -> None:
        """A decode-only step of `batch` sequences (`drafts`: it verified some) took
        `seconds`."""
        if batch <= 0 or seconds < 0:
            return
        self._sides.record(self.bucket_of(batch), drafts, seconds / batch)

    def summary(self) -> dict[str, float | None]:
        """Per bucket (named by its largest batch): the cost ratio (the readout, benchmarks)."""
        return {str(2**key): self.cost_ratio(2**key) for key in sorted(self._sides.buckets())}
