"""Adapter slots, torch-free: the LRU table the device slots follow, and the scheduler keeping
the running adapters within the slots without starving an adapter that waits for one."""

from __future__ import annotations

import pytest

from backends.llm.kv_cache_manager import KVCacheManager
from backends.llm.lora.slots import Placement, SlotTable
from backends.llm.sampling_params import SamplingParams
from backends.llm.scheduler import Scheduler, SchedulerLimits
from backends.llm.sequence import Sequence
from tests.backends.llm.fake_runner import EOS, FakeRunner

pytestmark = pytest.mark.pure


def test_the_least_recently_used_adapter_outside_the_step_leaves_its_slot() -> None:
    table = SlotTable(2)
    assert table.assign(["a", "b"]) == [Placement(0, "a", None), Placement(1, "b", None)]
    assert table.assign(["a"]) == []  # resident: no copy; "a" is now the most recent
    assert table.assign(["c"]) == [Placement(1, "c", "b")]
    assert table.assign(["c", "a"]) == []
    assert table.assign(["b", "c"]) == [Placement(0, "b", "a")]
    assert table.drop("c") == 1 and table.resident == ["b"]
    with pytest.raises(ValueError, match="3 adapters in one step; only 2 slots"):
        table.assign(["a", "b", "c"])


def test_running_adapters_stay_within_the_slots_and_every_adapter_gets_its_turn() -> None:
    kv = KVCacheManager(256, 4, enable_prefix_caching=True)
    limits = SchedulerLimits(8, 64, 256, 1000, max_loras=2)
    scheduler, runner = Scheduler(limits, kv, [EOS]), FakeRunner(4)
    params = SamplingParams(temperature=0.0)
    # A steady stream for adapters a and b, one request for c behind the first of them, and
    # base requests: c must not wait for the stream to end, the base never waits for a slot.
    adapters = ["a", "b", "c", None] + ["a", "b", None] * 6
    for i, adapter in enumerate(adapters):
        seq = Sequence(i, str(i), [3 + i, 4, 5], params, max_tokens=6, block_size=4)
        seq.adapter = adapter
        scheduler.add(seq)
    finished_at: dict[str, int] = {}
    steps = 0
    while scheduler.num_unfinished:
        output = scheduler.schedule()
        in_step = {item.seq.adapter for item in output.scheduled} - {None}
        assert len(in_step) <= 2
        assert len({s.adapter for s in scheduler.running} - {None}) <= 2
        for seq, _ in scheduler.update(output, runner.execute(output)):
            if seq.is_finished:
                finished_at[seq.request_id] = steps
        steps += 1
        assert steps < 1000
    last_a = max(t for rid, t in finished_at.items() if adapters[int(rid)] == "a")
    assert finished_at["2"] < last_a  # c was served before a's stream ended
