"""The two-sided measurement both adaptive choices share (fused threads, speculation cost):
each side measured before they are compared, the faster side then, a probe of the other now
and then, and no measurement of the slower side on a step that may not probe. Samples are
made up, so nothing here depends on the machine."""

from __future__ import annotations

import statistics

import pytest

from backends.llm.two_sided import TwoSided


def lower(a: float, b: float) -> bool:
    return b < a


def sides() -> TwoSided[int]:
    return TwoSided(window=4, min_samples=2, score=statistics.median, probe_a_every=3,
                    probe_b_every=5)  # fmt: skip


def run(two: TwoSided[int], steps: int, seconds: dict[bool, float], **kw: bool) -> list[bool]:
    """Sides taken by `steps` steps of bucket 0 where side B takes `seconds[True]`."""
    taken = []
    for _ in range(steps):
        b = two.choose(0, lower, **kw)
        two.record(0, b, seconds[b])
        taken.append(b)
    return taken


def test_both_sides_are_measured_then_the_faster_one_runs_with_probes() -> None:
    two = sides()
    assert run(two, 4, {False: 1.0, True: 2.0}) == [False, False, True, True]
    assert two.measured(0) and two.winner(0, lower) is False
    assert run(two, 10, {False: 1.0, True: 2.0}).count(True) == 2  # one in probe_b_every
    # B turns faster: once its probe shows it, A is only probed.
    later = run(two, 30, {False: 1.0, True: 0.5})
    assert later[-9:].count(False) == 3 and two.winner(0, lower) is True
    assert two.score(0, True) == 0.5 and two.score(1, True) is None


def test_a_step_that_may_not_probe_stays_on_the_side_measured_first() -> None:
    two = sides()
    assert run(two, 6, {False: 1.0, True: 0.5}, may_probe=False) == [False] * 6
    assert two.samples(0, True) == 0 and not two.measured(0)
    assert run(two, 2, {False: 1.0, True: 0.5}) == [True, True]  # measured where it may
    # A bucket told to measure B first does so, then A.
    assert run(sides(), 4, {False: 1.0, True: 0.5}, first=True) == [True, True, False, False]


def test_a_window_smaller_than_the_samples_it_needs_is_refused() -> None:
    with pytest.raises(ValueError, match="min_samples"):
        TwoSided(window=2, min_samples=3, score=statistics.median, probe_a_every=1,
                 probe_b_every=1)  # fmt: skip
