"""The state of one generated sequence; pure Python, no torch.

There is no prefill phase or decode phase: a sequence has `num_tokens` (prompt plus output)
and `num_computed_tokens` whose KV is in the cache, and each step computes some of the
difference. A prompt is a long difference (spread over steps by chunked prefill), a decode
a difference of one, a preempted sequence (its blocks freed) starts again from zero.

Full blocks of tokens get a chained hash, `hash((parent hash, block tokens))`, computed as
blocks fill; the prefix cache finds identical prefixes by these hashes. The chain starts at
`root_hash`: `ROOT_HASH` for the base model, one of its own for each loaded LoRA adapter, so
the same tokens under two adapters never share KV.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

from backends.llm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from backends.llm.structured.guide import TokenGuide

# The parent hash of a sequence's first block.
ROOT_HASH = 0


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # eos, a stop token id or a stop string
    LENGTH = "length"  # max_tokens, or the model's context is full
    ABORT = "abort"  # the client went away or the request was cancelled


@dataclass(frozen=True)
class Logprob:
    """A generated token's log-probability and, when asked, the most likely alternatives."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def block_hash(parent: int, tokens: tuple[int, ...]) -> int:
    return hash((parent, tokens))


class Sequence:
    """One sample of one request: its tokens, progress, KV blocks and stopping state."""

    __slots__ = (
        "adapter",
        "arrival",
        "block_hashes",
        "block_ids",
        "block_size",
        "draft_token_ids",
        "finish_reason",
        "guide",
        "index",
        "max_tokens",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_inflight",
        "num_preemptions",
        "num_prompt_tokens",
        "params",
        "priority",
        "request_id",
        "root_hash",
        "seq_id",
        "spec_accepted",
        "spec_proposed",
        "status",
        "stop_reason",
        "token_ids",
    )

    def __init__(
        self,
        seq_id: int,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        max_tokens: int,
        block_size: int,
        index: int = 0,
        priority: int = 0,
        arrival: int = 0,
        adapter: str | None = None,
        root_hash: int = ROOT_HASH,
    ) -> None:
        self.seq_id = seq_id
        self.request_id = request_id
        self.index = index
        self.params = params
        self.max_tokens = max_tokens
        self.priority = priority
        # The step at which the request arrived: FCFS order and priority aging.
        self.arrival = arrival
        # The LoRA adapter the sequence runs with (None: the base model) and the root of its
        # block-hash chain.
        self.adapter = adapter
        self.root_hash = root_hash
        self.block_size = block_size
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        # Tokens sampled by steps launched but not landed yet (asynchronous steps,
        # `Scheduler.advance`): they follow `token_ids`, and the next step may already
        # compute the first of them on the device.
        self.num_inflight = 0
        # Prompt tokens served from the prefix cache when first scheduled.
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        self.block_ids: list[int] = []
        self.block_hashes: list[int] = []
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        # The stop token id or stop string that ended the sequence, if one did.
        self.stop_reason: int | str | None = None
        # The grammar state of a structured request; it follows `token_ids`, so preemption
        # (which keeps the tokens and recomputes their KV) leaves it as it is.
        self.guide: TokenGuide | None = None
        # Speculative decoding: tokens proposed for the next step (taken by the scheduler),
        # and how many were proposed and accepted so far (backends.llm.speculative).
        self.draft_token_ids: list[int] = []
        self.spec_proposed = 0
        self.spec_accepted = 0
        self._hash_full_blocks()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        if len(self.token_ids) % self.block_size == 0:
            self._hash_full_blocks()

    def block_tokens(self, block_index: int) -> tuple[int, ...]:
        start = block_index * self.block_size
        return tuple(self.token_ids[start : start + self.block_size])

    def finish(self, reason: FinishReason, stop_reason: int | str | None = None) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason

    def _hash_full_blocks(self) -> None:
        num_full = len(self.token_ids) // self.block_size
        for i in range(len(self.block_hashes), num_full):
            parent = self.block_hashes[i - 1] if i else self.root_hash
            self.block_hashes.append(block_hash(parent, self.block_tokens(i)))

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id}#{self.index}, {self.status.value}, "
            f"computed {self.num_computed_tokens}/{self.num_tokens}, blocks {len(self.block_ids)})"
        )
