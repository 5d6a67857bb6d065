"""Sticky weighted assignment: the split is honoured, keys stay put, and weight changes move
keys only towards the versions whose weight grew."""

from __future__ import annotations

import random

import numpy as np
import pytest
from scipy.stats import chisquare

from hub.routing.assignment import BUCKETS, Arm, AssignmentTable, bucket_of, random_bucket

V1, V2, V3 = Arm("emb", 1), Arm("emb", 2), Arm("emb", 3)


def keys(n: int, seed: int = 7) -> list[str]:
    rng = random.Random(seed)
    return [f"user-{rng.getrandbits(64):016x}" for _ in range(n)]


def assign(table: AssignmentTable, ks: list[str]) -> list[Arm]:
    return [table.arm(bucket_of(table.model, k)) for k in ks]


def test_buckets_are_stable_hashes_not_pythons_hash() -> None:
    # Pinned values: every replica, restart and Python process must agree (PYTHONHASHSEED
    # changes `hash()` per process; this must not).
    assert (bucket_of("emb", "alice"), bucket_of("emb", "bob")) == (4764, 6985)
    assert bucket_of("other", "alice") != bucket_of("emb", "alice")  # the model is hashed too
    assert all(0 <= random_bucket() < BUCKETS for _ in range(100))


def test_ten_thousand_keys_on_a_90_10_split_pass_the_chi_square_check() -> None:
    table = AssignmentTable("emb", [(V1, 90), (V2, 10)])
    arms = assign(table, keys(10_000))
    observed = [arms.count(V1), arms.count(V2)]
    p = chisquare(observed, [9000, 1000]).pvalue
    assert p > 0.001, (observed, p)
    shares = table.shares()
    assert abs(shares[V2] - 0.10) < 0.01  # the table itself holds ~10% of the buckets


def test_the_same_key_always_lands_on_the_same_version() -> None:
    ks = keys(2000)
    first = assign(AssignmentTable("emb", [(V1, 90), (V2, 10)]), ks)
    # A fresh table (another replica, a restart) with the same weights agrees key by key.
    again = assign(AssignmentTable("emb", [(V2, 10), (V1, 90)]), ks)
    assert first == again
    table = AssignmentTable("emb", [(V1, 90), (V2, 10)])
    assert all(assign(table, ks[:50]) == first[:50] for _ in range(3))


def test_raising_the_canary_from_10_to_20_moves_about_10_percent_towards_it() -> None:
    ks = keys(10_000)
    before = assign(AssignmentTable("emb", [(V1, 90), (V2, 10)]), ks)
    after = assign(AssignmentTable("emb", [(V1, 80), (V2, 20)]), ks)
    moved = [(a, b) for a, b in zip(before, after, strict=True) if a != b]
    assert 0.08 <= len(moved) / len(ks) <= 0.12, len(moved)
    assert all((a, b) == (V1, V2) for a, b in moved)  # only towards the canary


def test_three_versions_keys_move_only_towards_the_version_that_grew() -> None:
    ks = keys(10_000)
    before = assign(AssignmentTable("emb", [(V1, 60), (V2, 20), (V3, 20)]), ks)
    # V3 rises 20 -> 40 while V1 and V2 keep their 3:1 proportion.
    after = assign(AssignmentTable("emb", [(V1, 45), (V2, 15), (V3, 40)]), ks)
    moved = [(a, b) for a, b in zip(before, after, strict=True) if a != b]
    assert moved and all(b == V3 for _, b in moved)
    assert {a for a, _ in moved} == {V1, V2}


def test_a_general_reweighting_moves_keys_only_to_relatively_grown_versions() -> None:
    """50/30/20 -> 40/30/30: relative growth V1 0.8, V2 1.0, V3 1.5. Rendezvous moves a key
    from X to Y only if Y grew relatively more than X: V1 -> V2, V1 -> V3, V2 -> V3; never
    away from V3 and never into V1."""
    ks = keys(10_000)
    before = assign(AssignmentTable("emb", [(V1, 50), (V2, 30), (V3, 20)]), ks)
    after = assign(AssignmentTable("emb", [(V1, 40), (V2, 30), (V3, 30)]), ks)
    moves = {(a, b) for a, b in zip(before, after, strict=True) if a != b}
    assert moves <= {(V1, V2), (V1, V3), (V2, V3)}
    assert (V1, V3) in moves


def test_zero_weights_and_empty_splits() -> None:
    table = AssignmentTable("emb", [(V1, 100), (V2, 0)])
    assert table.arms == (V1,) and set(table.shares()) == {V1}
    with pytest.raises(ValueError, match="at least one version with weight > 0"):
        AssignmentTable("emb", [(V1, 0)])


def test_arms_across_models_are_distinct() -> None:
    other = Arm("other", 1)
    table = AssignmentTable("emb", [(V1, 50), (other, 50)])
    shares = table.shares()
    assert abs(shares[other] - 0.5) < 0.02
    assert other.label("emb") == "other@1" and V1.label("emb") == "1"
    assert np.isclose(sum(shares.values()), 1.0)
