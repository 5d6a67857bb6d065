"""How many threads a fused step runs on: all it may use, or half, whichever has been faster
lately at this step's size.

The fused step's threads meet at a barrier after every stage (a few per layer, dozens a
step). When another process holds a core, the thread that shares it is descheduled for a
time slice now and then, and every other thread waits at the next barrier for it: a step of
a few milliseconds takes tens or hundreds. On a quiet machine the same threads make the step
faster. Neither count is right everywhere, and the machine's load changes, so both are
measured (`backends.llm.two_sided`):

- steps are timed in two windows per row-count bucket (1, 2, 3-4, 5-8, ...): at the most
  threads the step may use and at half as many (one, on two cores);
- each side is scored by the mean of its window without its slowest step: a stall that
  recurs raises the mean, as it raises the time a stream takes, while a single delay the OS
  caused once does not decide;
- a bucket not measured on both sides yet runs on the side that wins in the nearest bucket
  that is (all threads where none is), until `MIN_SAMPLES` are in; the other side is then
  measured, as many steps, but only on steps that may probe (decodes: a step at half the
  speed costs one token's latency there, where on a prefill it would cost the time to the
  first token);
- after that a step runs on fewer threads only where they score lower by `FEWER_MARGIN`
  (else on all threads: a window a few stalls inflated is noise, a contended team's
  stalls cost far more than the margin), and now
  and then a step that may probe takes the other side (`PROBE_FEWER_EVERY`,
  `PROBE_MOST_EVERY`), so that a change of load turns the choice back;
- while fewer threads win, a probe on all threads that comes back faster than fewer threads
  score is confirmed at once: the next steps that may probe run on all threads too, up to
  `CONFIRM_STEPS`, for as long as each is faster than fewer threads score. A burst of
  stalls while another process woke (a few steps) fills the window of all threads with slow
  steps, and probes one step in `PROBE_MOST_EVERY` alone took a hundred steps at the slower
  count to replace them; confirmed, all threads come back within a probe's period. Under
  load that lasts, a confirmation ends at its first stall: one stalled step more a probe.

The thread count changes no result: every output is computed by one thread in the same
order however many share a stage.
"""

from __future__ import annotations

import collections
import statistics
from collections.abc import Callable, Sequence

from backends.llm.two_sided import TwoSided

# Recent steps kept per bucket and side: short, so that the choice follows the load within
# a few hundred steps once it changes.
WINDOW = 8
# Steps measured on each side before the two are compared.
MIN_SAMPLES = 3
# One step in this many (per bucket) takes the side not chosen, to keep it measured: rarely
# while all threads win (a probe on a quiet machine costs a step at half the speed, and a
# change of load shows in the steps run on all threads themselves), more often while fewer
# win, so that all threads come back soon after the load lifts.
PROBE_FEWER_EVERY = 64
PROBE_MOST_EVERY = 32
# Fewer threads win only by this fraction of all threads' score: on a quiet machine all
# threads are a quarter or more faster at every step size, so a window that a few stalls
# brought within this margin is noise, while a contended machine's stalls make all threads
# slower by far more.
FEWER_MARGIN = 0.15
# Steps on all threads after a probe of them that beat fewer threads' score, while each does
# (a window's worth: enough for all threads to win again if the load has lifted).
CONFIRM_STEPS = WINDOW - 1

# A bucket: (the exponent of its largest row count, the most threads its steps may use).
Bucket = tuple[int, int]


def _score(window: Sequence[float]) -> float:
    """The window's mean without its slowest step."""
    if len(window) < 2:
        return statistics.fmean(window)
    return (sum(window) - max(window)) / (len(window) - 1)


def _fewer_wins(most: float, fewer: float) -> bool:
    return fewer < most * (1.0 - FEWER_MARGIN)


class ThreadChoice:
    """Per step size, whether a fused step runs on all its threads or on half: `threads`
    picks for a step, `observe` records what one took; `steps` counts the steps observed by
    the threads they ran on. One per model runner (its steps are run one at a time)."""

    def __init__(self) -> None:
        # Side A: the most threads; side B: fewer.
        self._sides: TwoSided[Bucket] = TwoSided(
            window=WINDOW,
            min_samples=MIN_SAMPLES,
            score=_score,
            probe_a_every=PROBE_MOST_EVERY,
            probe_b_every=PROBE_FEWER_EVERY,
        )
        self.steps: collections.Counter[int] = collections.Counter()  # steps by threads run
        # Called with each observed step's thread count (the engine's Prometheus counter).
        self.on_step: Callable[[int], None] | None = None
        # Per bucket: steps on all threads still to confirm a fast probe of them.
        self._confirm: dict[Bucket, int] = {}

    @staticmethod
    def bucket_of(rows: int) -> int:
        """1, 2, 3-4, 5-8, ... rows share a bucket (the exponent of its largest power of 2)."""
        return (rows - 1).bit_length()

    @staticmethod
    def fewer(most: int) -> int:
        """The other side of `most` threads: half as many, at least one."""
        return max(1, most // 2)

    def _nearest_winner(self, key: Bucket) -> bool:
        """Whether fewer threads win in the measured bucket nearest `key` (of the same most
        threads; the smaller on a tie); False where none is measured."""
        exponent, most = key
        sides = self._sides
        measured = [k for k in sides.buckets() if k[1] == most and k != key and sides.measured(k)]
        if not measured:
            return False
        nearest = min(measured, key=lambda k: (abs(k[0] - exponent), k[0]))
        return bool(self._sides.winner(nearest, _fewer_wins))

    def threads(self, rows: int, most: int, *, may_probe: bool = True) -> int:
        """Threads a step of `rows` rows should run on, when it may use up to `most`.
        `may_probe` False: the step must not be spent measuring the side believed slower
        (a prefill); it runs on the side believed faster."""
        if most <= 1:
            return 1
        key = (self.bucket_of(rows), most)
        if may_probe and self._confirm.get(key, 0) > 0:
            self._confirm[key] -= 1
            return most
        first = False if self._sides.measured(key) else self._nearest_winner(key)
        fewer = self._sides.choose(key, _fewer_wins, first=first, may_probe=may_probe)
        return self.fewer(most) if fewer else most

    def observe(self, rows: int, most: int, threads: int, seconds: float) -> None:
        """A step of `rows` rows, allowed `most` threads, ran on `threads` in `seconds`."""
        if most <= 1 or rows <= 0 or seconds < 0:
            return
        self.steps[threads] += 1
        if self.on_step is not None:
            self.on_step(threads)
        key = (self.bucket_of(rows), most)
        if threads == most:
            if self._sides.winner(key, _fewer_wins):  # a probe, or a step confirming one
                fewer = self._sides.score(key, True)
                if fewer is None or seconds >= fewer:
                    self._confirm.pop(key, None)  # slower than fewer threads: no more
                elif key not in self._confirm:
                    self._confirm[key] = CONFIRM_STEPS
            self._sides.record(key, False, seconds)
            if key in self._confirm and not self._sides.winner(key, _fewer_wins):
                self._confirm.pop(key, None)  # all threads win again
        elif threads == self.fewer(most):
            self._sides.record(key, True, seconds)

    def summary(self) -> dict[str, dict[str, float | None]]:
        """Per bucket (named by its largest row count and the most threads): each side's
        score in seconds, None until measured (benchmarks, the readout)."""
        return {
            f"{2**key}x{most}": {
                "most": self._sides.score((key, most), False),
                "fewer": self._sides.score((key, most), True),
            }
            for key, most in sorted(self._sides.buckets())
        }
