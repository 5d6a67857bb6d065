"""Sticky, weighted assignment of requests to versions.

A request's bucket (0..9999) is a stable hash of (model name, routing key); requests without
a key get a random bucket. Buckets map to versions by *weighted rendezvous hashing*: bucket
b goes to the arm a with weight w_a > 0 that minimises -ln(u(b, a)) / w_a, where u(b, a) in
(0, 1) is a stable hash of (model, b, a). The map is a pure function of the model name and
the weights, so every replica computes the same table with no shared state.

Why rendezvous: when weights change, a bucket only moves from arm X to arm Y if Y's weight
grew relative to X's (w'_Y / w_Y > w'_X / w_X). Raising one version's weight while the others
keep their proportions therefore moves keys only towards it (a 90/10 -> 80/20 canary step
moves about 10% of keys, all to the canary), and a key stays on its version for as long as
the weights do not push it away. The share of buckets an arm gets is its weight up to
sampling noise of the 10,000 buckets (about ±0.3 percentage points at 10%): `shares()` is
what the router actually does and what the sample-ratio check expects.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

BUCKETS = 10_000
_TWO64 = float(2**64)


@dataclass(frozen=True, order=True)
class Arm:
    """A version that can answer for a model: its own, or another model's of the same kind."""

    model: str
    version: int

    def label(self, public_name: str) -> str:
        """How readouts and `X-Hub-Model-Version` name it: `3`, or `other@3` across models."""
        return str(self.version) if self.model == public_name else f"{self.model}@{self.version}"


def _hash64(*parts: str) -> int:
    data = "\x00".join(parts).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def bucket_of(model: str, key: str) -> int:
    """The bucket of routing key `key` for `model`: the same on every replica and restart."""
    return _hash64("bucket", model, key) % BUCKETS


def random_bucket(rng: random.Random | None = None) -> int:
    """A bucket for a request without a routing key."""
    return (rng or random).randrange(BUCKETS)


@lru_cache(maxsize=256)
def _rendezvous_costs(model: str, arm: Arm) -> np.ndarray:
    """-ln u(b, arm) for every bucket b: exponential(1) draws fixed by the hash. Cached: they
    do not depend on weights, so a weight change only redoes the argmin."""
    arm_id = f"{arm.model}@{arm.version}"
    u = np.array(
        [(_hash64("arm", model, arm_id, str(b)) + 0.5) / _TWO64 for b in range(BUCKETS)],
        dtype=np.float64,
    )  # (BUCKETS,), strictly inside (0, 1)
    costs = -np.log(u)
    costs.flags.writeable = False
    return costs


class AssignmentTable:
    """bucket -> arm for one model's weights; immutable once built."""

    def __init__(self, model: str, weights: Sequence[tuple[Arm, float]]) -> None:
        live = [(arm, float(w)) for arm, w in weights if w > 0]
        if not live:
            raise ValueError(f"{model}: a split needs at least one version with weight > 0")
        self.model = model
        self.arms: tuple[Arm, ...] = tuple(arm for arm, _ in live)
        self.weights: tuple[float, ...] = tuple(w for _, w in live)
        costs = np.stack([_rendezvous_costs(model, arm) for arm in self.arms])  # (arms, B)
        scores = costs / np.asarray(self.weights)[:, None]
        self._index = np.argmin(scores, axis=0).astype(np.int32)  # (B,)
        self._index.flags.writeable = False

    def arm(self, bucket: int) -> Arm:
        return self.arms[int(self._index[bucket])]

    def shares(self) -> dict[Arm, float]:
        """Fraction of buckets each arm receives (what random keys converge to)."""
        counts = np.bincount(self._index, minlength=len(self.arms))
        return {arm: float(c) / BUCKETS for arm, c in zip(self.arms, counts, strict=True)}
