"""Steps launched ahead of their tokens (the engine's `async_steps`).

Contract: `Launcher(runner)` decides and runs the runner's side. `static_step(output)` is the
static decode step a schedule can be launched on without waiting for its tokens (single-token
decodes on the runner's static path, every row its logits' argmax and nothing else, so no
host state has to follow a token), or None. `launch(output, step, previous)` queues the
forward, the argmax and the tokens' copy to the host without waiting; inputs still in flight
come from `previous`'s tokens on the device. `collect(launched)` waits for the tokens (the one
wait). `may_continue(running)` says whether, with a step in flight, the next can be scheduled
before its tokens land: every running sequence a plain greedy decode without an adapter,
exactly one token pending (so the scheduler gives each its next position) and no more than
the largest bucket. The engine keeps the rest: what runs in flight (`Inflight`) and landing
it (`backends.llm.engine`), the scheduler's accounting (`Scheduler.advance` / `resolve`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from backends.llm.sampler.transfer import Download, start_download
from backends.llm.scheduler import SchedulerOutput
from backends.llm.sequence import Sequence

if TYPE_CHECKING:
    from backends.llm.decode_graphs import StaticDecode
    from backends.llm.model_runner import ModelRunner


@dataclass(frozen=True)
class LaunchedStep:
    """A decode step launched without waiting for its tokens."""

    # The sampled tokens on the device (the next step's inputs where they are in flight).
    tokens: torch.Tensor
    # Their copy to the host, queued behind the step.
    download: Download
    # Row of each of the step's sequences, by sequence id.
    rows: dict[int, int]


@dataclass(frozen=True)
class Inflight:
    """A launched step as the engine keeps it until it lands."""

    output: SchedulerOutput
    launched: LaunchedStep
    started: float
    scheduled_at: float
    # The engine's counters when it started (`LLMEngine._marks`).
    marks: tuple[int, int, int]


class Launcher:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def static_step(self, output: SchedulerOutput) -> StaticDecode | None:
        items = output.scheduled
        if not items or any(item.drafts or not item.sample for item in items):
            return None
        if not self.runner.sampler.greedy_only([item.seq for item in items]):
            return None
        return self.runner.graphs.for_step(output)

    def launch(
        self, output: SchedulerOutput, step: StaticDecode, previous: LaunchedStep | None
    ) -> LaunchedStep:
        runner = self.runner
        runner.sampler.forget(output.finished_seq_ids)
        fed = None if previous is None else (previous.tokens, previous.rows)
        with torch.inference_mode():
            logits = step.run(output.scheduled, runner.before_forward, fed)
            tokens = logits.argmax(dim=-1)
            rows = {item.seq.seq_id: i for i, item in enumerate(output.scheduled)}
            return LaunchedStep(tokens, start_download(tokens), rows)

    def collect(self, launched: LaunchedStep) -> list[int]:
        tokens: list[int] = launched.download.wait().tolist()
        return tokens

    def may_continue(self, running: list[Sequence]) -> bool:
        if len(running) > self.runner.graphs.buckets[-1]:
            return False
        return self.runner.sampler.greedy_only(running) and all(
            seq.adapter is None
            and len(seq.token_ids) + seq.num_inflight - seq.num_computed_tokens == 1
            for seq in running
        )


def unfinished(output: SchedulerOutput) -> SchedulerOutput:
    """`output` without the entries of sequences that ended since it was scheduled (a token
    that landed meanwhile ended them; their blocks are free)."""
    kept = [item for item in output.scheduled if not item.seq.is_finished]
    if len(kept) == len(output.scheduled):
        return output
    return dataclasses.replace(
        output, scheduled=kept, num_batched_tokens=sum(item.num_tokens for item in kept)
    )
