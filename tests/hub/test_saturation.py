"""The board of models the HTTP edge refuses at once (hub/saturation.py): a refusal for queue
time is remembered for exactly as long as the queue needs to drain to its bound, and
forgotten when the registry snapshot its route came from is replaced. Torch-free."""

from __future__ import annotations

import pytest

from backends.errors import CapacityError
from hub.saturation import Saturation

# Torch-free: also run in a bare environment (make test-pure).
pytestmark = pytest.mark.pure


def board() -> tuple[Saturation, list[float], list[object]]:
    now, snapshot = [100.0], [object()]
    return Saturation(lambda: snapshot[0], clock=lambda: now[0]), now, snapshot


def test_a_refusal_holds_for_the_time_the_queue_needs_to_drain() -> None:
    saturation, now, _ = board()
    assert not saturation
    saturation.mark(
        "emb", 3, "embedder", CapacityError("emb is overloaded", retry_after=2, saturated_s=0.5)
    )
    assert saturation
    entry = saturation.refusal("emb")
    assert entry is not None and (entry.model, entry.version) == ("emb", 3)
    assert entry.retry_after == 2 and entry.message == "emb is overloaded"
    assert saturation.refusal("other") is None
    now[0] += 0.49
    assert saturation.refusal("emb") is not None
    now[0] += 0.02
    assert saturation.refusal("emb") is None
    assert not saturation


def test_a_refusal_without_a_drain_time_is_not_remembered() -> None:
    saturation, _, _ = board()
    saturation.mark("emb", 1, "embedder", CapacityError("queue full"))  # max_queue: no estimate
    assert saturation.refusal("emb") is None and not saturation


def test_a_new_registry_snapshot_forgets_the_refusal() -> None:
    """A promotion or a new split changes where the name goes."""
    saturation, _, snapshot = board()
    saturation.mark("emb", 1, "embedder", CapacityError("busy", saturated_s=10))
    assert saturation.refusal("emb") is not None
    snapshot[0] = object()
    assert saturation.refusal("emb") is None


def test_the_board_empties_when_its_last_refusal_runs_out() -> None:
    """Also where a model's refusal was renewed with a shorter drain time than before."""
    saturation, now, _ = board()
    saturation.mark("emb", 1, "embedder", CapacityError("busy", saturated_s=10))
    saturation.mark("rr", 1, "reranker", CapacityError("busy", saturated_s=0.5))
    now[0] += 0.6
    assert saturation and saturation.refusal("rr") is None
    saturation.mark("emb", 1, "embedder", CapacityError("less busy", saturated_s=0.1))
    assert saturation
    now[0] += 0.2
    assert not saturation and saturation.refusal("emb") is None
