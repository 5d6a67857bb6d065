"""The ledger never charges a device past its budget; the host tier drops its least
recently parked models first, never one that is held."""

from __future__ import annotations

import random

import pytest

from hub.manager.planning import HostTier, MemoryLedger, ModelKey, OverBudget
from tests.hub.manager.planning.support import MiB, key

pytestmark = pytest.mark.pure


def test_a_charge_past_the_budget_is_refused_and_changes_nothing() -> None:
    ledger = MemoryLedger({"cpu": 100 * MiB, "cuda:0": 50 * MiB})
    ledger.reserve(key("a"), "cpu", 60 * MiB)
    with pytest.raises(OverBudget, match="past its budget"):
        ledger.reserve(key("b"), "cpu", 41 * MiB)
    assert ledger.used("cpu") == 60 * MiB and ledger.charge_of(key("b")) == 0
    ledger.reserve(key("b"), "cpu", 40 * MiB)
    assert ledger.free("cpu") == 0
    # One model is charged to one device only.
    with pytest.raises(OverBudget, match="charged to cpu"):
        ledger.reserve(key("a"), "cuda:0", MiB)
    ledger.shrink(key("a"), 20 * MiB)  # measured below its reservation
    assert ledger.charge_of(key("a")) == 20 * MiB and ledger.free("cpu") == 40 * MiB
    assert ledger.release(key("a")) == 20 * MiB and ledger.release(key("a")) == 0
    assert ledger.device_of(key("a")) is None and ledger.charges("cpu") == {key("b"): 40 * MiB}


@pytest.mark.parametrize("seed", range(5))
def test_random_charges_never_exceed_any_budget(seed: int) -> None:
    rng = random.Random(seed)
    budgets = {"cpu": 64 * MiB, "cuda:0": 32 * MiB}
    ledger = MemoryLedger(budgets)
    keys = [ModelKey(f"m{i}", 1) for i in range(8)]
    refused = 0
    for _ in range(500):
        k = rng.choice(keys)
        action = rng.random()
        if action < 0.5:
            device = ledger.device_of(k) or rng.choice(list(budgets))
            try:
                ledger.reserve(k, device, rng.randint(1, 20) * MiB)
            except OverBudget:
                refused += 1
        elif action < 0.7 and ledger.device_of(k) is not None:
            ledger.shrink(k, rng.randint(0, 20) * MiB)
        else:
            ledger.release(k)
        for device, budget in budgets.items():
            assert 0 <= ledger.used(device) <= budget
            assert ledger.free(device) == budget - sum(ledger.charges(device).values())
    assert refused > 0  # the budgets were really tested


def test_host_tier_drops_least_recently_parked_first_and_never_a_held_one() -> None:
    tier = HostTier(100 * MiB)
    for name in "abc":
        tier.add(key(name), 30 * MiB)
    assert tier.used_bytes == 90 * MiB and len(tier) == 3 and key("a") in tier
    assert tier.victims_for(10 * MiB) == []  # fits already
    assert tier.victims_for(40 * MiB) == [key("a")]
    assert tier.victims_for(70 * MiB) == [key("a"), key("b")]
    tier.hold(key("a"))  # being restored: never dropped
    assert tier.victims_for(40 * MiB) == [key("b")]
    assert tier.victims_for(80 * MiB) == []  # only a dropping a held model would do
    assert tier.admits(70 * MiB) and not tier.admits(71 * MiB)
    tier.unhold(key("a"))
    assert tier.admits(100 * MiB) and not tier.admits(101 * MiB)
    with pytest.raises(RuntimeError, match="no room"):
        tier.add(key("d"), 20 * MiB)
    assert tier.remove(key("a")) == 30 * MiB and tier.remove(key("a")) == 0
    tier.add(key("d"), 20 * MiB)
    # Parked order is the drop order: b, c, then the newly parked d.
    assert tier.victims_for(100 * MiB) == [key("b"), key("c"), key("d")]
