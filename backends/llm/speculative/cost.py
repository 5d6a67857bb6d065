"""Whether speculation pays at a batch size: time per emitted token with drafts against without.

Acceptance alone does not say whether drafts pay: a verify step costs more than a plain one
(more rows, the proposer's own work), and how much more depends on the model, the machine and
the batch (a step bound by streaming weights verifies a few drafts nearly for free, one bound
by compute pays for every row). So the engine's decode-only steps are timed, in two windows
per batch-size bucket (1, 2, 3-4, 5-8, ...): steps that verified drafts and steps that did
not, each as seconds and tokens emitted. Speculation goes on in a bucket while its recent
seconds per token with drafts are below those without.

Both sides are kept measured: the first steps of a bucket run plain until `MIN_SAMPLES` are
in, then speculate until as many are; after that, one step in `PROBE_EVERY` takes the choice
not currently made, so a change of load or acceptance turns speculation back on (or off).
Each window's cost is its seconds over its tokens, each step's seconds clipped at
`OUTLIER_FACTOR` times the window's median step (a step the OS delayed does not decide).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

# Recent steps kept per bucket and side.
WINDOW = 16
# Steps measured on each side before the costs are compared.
MIN_SAMPLES = 3
# One step in this many (per bucket) takes the other side, to keep it measured.
PROBE_EVERY = 32
# A step longer than this many times the window's median counts as that long.
OUTLIER_FACTOR = 3.0


@dataclass
class _Side:
    """Recent steps of one kind: (seconds, tokens emitted) each."""

    steps: collections.deque[tuple[float, int]] = field(
        default_factory=lambda: collections.deque(maxlen=WINDOW)
    )

    def seconds_per_token(self) -> float:
        times = sorted(t for t, _ in self.steps)
        cap = OUTLIER_FACTOR * times[len(times) // 2]
        tokens = sum(n for _, n in self.steps)
        return sum(min(t, cap) for t, _ in self.steps) / tokens


@dataclass
class _Bucket:
    plain: _Side = field(default_factory=_Side)
    drafts: _Side = field(default_factory=_Side)
    decisions: int = 0


class SpeculationCost:
    """Time per token with and without drafts, by batch size; `speculate(batch)` says
    whether to propose in a step of `batch` decoding sequences, `observe` records a step."""

    def __init__(self, *, by_cost: bool = True) -> None:
        """`by_cost` False: every step speculates (tests of what drafts do, not of when)."""
        self.by_cost = by_cost
        self._buckets: dict[int, _Bucket] = {}

    @staticmethod
    def bucket_of(batch: int) -> int:
        """1, 2, 3-4, 5-8, ... share a bucket (the index of its largest power of two)."""
        return (batch - 1).bit_length()

    def _bucket(self, batch: int) -> _Bucket:
        key = self.bucket_of(batch)
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = _Bucket()
        return bucket

    def speculate(self, batch: int) -> bool:
        """Whether a step of `batch` decoding sequences should propose drafts."""
        if not self.by_cost:
            return True
        bucket = self._bucket(batch)
        bucket.decisions += 1
        if len(bucket.plain.steps) < MIN_SAMPLES:
            return False
        if len(bucket.drafts.steps) < MIN_SAMPLES:
            return True
        pays = self.pays(batch)
        return (not pays) if bucket.decisions % PROBE_EVERY == 0 else bool(pays)

    def pays(self, batch: int) -> bool | None:
        """Whether recent steps with drafts cost less per token than those without at this
        batch size; None until both were measured."""
        bucket = self._buckets.get(self.bucket_of(batch))
        if bucket is None or not bucket.plain.steps or not bucket.drafts.steps:
            return None
        return bucket.drafts.seconds_per_token() < bucket.plain.seconds_per_token()

    def observe(self, batch: int, drafts: bool, seconds: float, tokens: int) -> None:
        """A decode-only step of `batch` sequences (`drafts`: it verified some) took
        `seconds` and emitted `tokens`."""
        if tokens <= 0 or seconds < 0:
            return
        bucket = self._bucket(batch)
        (bucket.drafts if drafts else bucket.plain).steps.append((seconds, tokens))

    def summary(self) -> dict[str, dict[str, float | None]]:
        """Per bucket (named by its largest batch): seconds per token each way (the readout,
        benchmarks)."""
        out: dict[str, dict[str, float | None]] = {}
        for key, bucket in sorted(self._buckets.items()):
            sides = {"plain": bucket.plain, "drafts": bucket.drafts}
            out[str(2**key)] = {
                f"{name}_s_per_token": side.seconds_per_token() if side.steps else None
                for name, side in sides.items()
            }
        return out
