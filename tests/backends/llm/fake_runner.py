"""A torch-free stand-in for the model runner, to test scheduling and the KV cache alone.

It keeps a simulated KV cache: each step first "writes" every scheduled token into its slot
(the token's whole prefix, standing for its K/V), then checks that every sequence that
samples can read its entire context through its block table, as attention would. The next
token is a fixed function of the sequence so far, so outputs must not depend on batching,
chunking, preemption or prefix sharing.
"""

from __future__ import annotations

from backends.llm.scheduler import Scheduler, SchedulerOutput
from backends.llm.sequence import Sequence

VOCAB = 50
EOS = 1


def next_token(tokens: list[int]) -> int:
    return (sum(tokens) * 31 + len(tokens) * 7) % (VOCAB - 3) + 3


class FakeRunner:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.kv: dict[int, tuple[int, ...]] = {}
        self.outputs: list[SchedulerOutput] = []

    def slot(self, seq: Sequence, position: int) -> int:
        bs = self.block_size
        return seq.block_ids[position // bs] * bs + position % bs

    def execute(self, output: SchedulerOutput) -> list[int]:
        self.outputs.append(output)
        for item in output.scheduled:
            for p in range(item.start, item.start + item.num_tokens):
                self.kv[self.slot(item.seq, p)] = tuple(item.seq.token_ids[: p + 1])
        sampled = []
        for item in output.scheduled:
            seq = item.seq
            end = item.start + item.num_tokens
            for p in range(end):
                stored = self.kv.get(self.slot(seq, p))
                assert stored == tuple(seq.token_ids[: p + 1]), (
                    f"{seq}: position {p} reads KV of another prefix"
                )
            if item.sample:
                sampled.append(next_token(seq.token_ids))
        return sampled


def run(scheduler: Scheduler, runner: FakeRunner, max_steps: int = 10_000) -> int:
    """Step until every sequence finished; returns the number of steps."""
    steps = 0
    while scheduler.num_unfinished:
        output = scheduler.schedule()
        scheduler.update(output, runner.execute(output))
        steps += 1
        assert steps < max_steps, "the scheduler made no progress"
    return steps
