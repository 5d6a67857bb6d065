"""Which tokens of which sequences run in the next step. Pure Python, no torch.

Each step has a token budget (`max_num_batched_tokens`) and a sequence cap (`max_num_seqs`).
Running sequences come first: every one that needs a single token (a decode) gets it, then
longer ones (prompts, recomputation after preemption) get chunks of what is left, so a long
prompt spreads over steps and mixes with decodes (chunked prefill). Waiting sequences are
admitted last, in order of precedence, and only while their blocks can be allocated; the first
that cannot be admitted stops admission, so a large request is never overtaken forever.

Precedence is `(level, arrival)`, lower first, where a sequence's level is its priority less
one per `priority_aging_steps` steps it has spent waiting (`backends.priority`: the classes
interactive, standard and batch are the levels -1, 0 and 1). FCFS inside a level, and a
request that waits long enough outranks any newcomer, so none starves: a batch request that
has waited twice `priority_aging_steps` is admitted ahead of every interactive request that
arrived after it. Only waiting ages a sequence; a running one keeps the level it was admitted
with, so a long generation does not become unpreemptable merely by running long.

Preemption frees a running sequence's blocks and sends it back to waiting, to be recomputed,
usually largely from the prefix cache since freed blocks keep their contents until reused.
It happens for two reasons. When blocks run out, the running sequence of lowest precedence
goes. And when a waiting sequence outranks a running one by a level (a class), it does not
wait for them: on admission, the lowest running sequence it outranks gives up its seat (at
`max_num_seqs`) or its blocks (when the pool is short), and outranked prompt chunks give up
the step's tokens, so the waiting sequence starts at this step with the budget an idle
engine would give it. The victim keeps its waiting age, so it comes back in turn.

A decoding sequence may carry drafts (`seq.draft_token_ids`, proposed by the engine's
speculator just before `schedule`): it is then scheduled as a chunk of its last token and
as many drafts as fit (the step's token budget, its `max_tokens`, the context, free blocks;
drafts never cause a preemption). `update` gets one sampled token per position of that chunk
and keeps the drafts the target agreed with, then the target's own token; the KV slots of
the rejected drafts are given back (`KVCacheManager.rollback`).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass, field

from backends.llm.kv_cache_manager import KVCacheManager
from backends.llm.sequence import FinishReason, Sequence, SequenceStatus
from backends.priority import aged_level


@dataclass(frozen=True)
class ScheduledSequence:
    seq: Sequence
    # This step computes tokens `seq.token_ids[start : start + num_tokens]`.
    start: int
    num_tokens: int
    # The chunk ends at the sequence's last token, so the step samples its next token.
    sample: bool
    # Draft tokens following the sequence's last token in this chunk (they are counted in
    # `num_tokens`); the step samples a token at every position from the last token on.
    drafts: tuple[int, ...] = ()

    @property
    def num_samples(self) -> int:
        """Sampled rows this entry takes: one per draft plus one, none if it does not sample."""
        return (len(self.drafts) + 1) if self.sample else 0


@dataclass(frozen=True)
class SchedulerOutput:
    """The one message the runner gets per step."""

    # Sequences with a single token this step first (attention batches them together),
    # then the longer chunks; tokens are packed in this order.
    scheduled: list[ScheduledSequence]
    # Sum of `num_tokens` over `scheduled`.
    num_batched_tokens: int
    # Sequences that finished or were aborted since the last step: drop their sampler state.
    finished_seq_ids: list[int] = field(default_factory=list)
    # Sequences preempted while scheduling this step (counted by metrics).
    num_preempted: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SchedulerLimits:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    priority_aging_steps: int
    # Distinct LoRA adapters among running sequences at most (the device's adapter slots).
    max_loras: int = 8


class Scheduler:
    def __init__(
        self, limits: SchedulerLimits, kv_cache: KVCacheManager, eos_token_ids: Iterable[int]
    ) -> None:
        if limits.max_num_batched_tokens < limits.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({limits.max_num_batched_tokens}) must be at least "
                f"max_num_seqs ({limits.max_num_seqs}) so every running sequence can decode"
            )
        self.limits = limits
        self.kv_cache = kv_cache
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: list[Sequence] = []
        # In precedence order, kept so as sequences start (a running sequence's precedence
        # does not change: only waiting ages it).
        self.running: list[Sequence] = []
        self.num_steps = 0
        self.num_preemptions = 0
        self._finished_ids: list[int] = []
        # Per unfinished sequence: steps it waited before its current state, and the step
        # its current wait began (waiting sequences only). Only waiting ages a sequence.
        self._waited: dict[int, int] = {}
        self._waiting_since: dict[int, int] = {}
        # Per entry of the last `update` that verified drafts: (proposed, accepted, emitted).
        self.verified: list[tuple[int, int, int]] = []

    # ---- queue ------------------------------------------------------------------------
    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, seq: Sequence) -> None:
        seq.arrival = self.num_steps
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        self._waited[seq.seq_id] = 0
        self._waiting_since[seq.seq_id] = self.num_steps

    def finish(
        self, seq: Sequence, reason: FinishReason, stop_reason: int | str | None = None
    ) -> None:
        """End `seq` now (a stop string, an abort) and free its blocks."""
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.kv_cache.free(seq)
        seq.finish(reason, stop_reason)
        self._finished_ids.append(seq.seq_id)
        self._waited.pop(seq.seq_id, None)
        self._waiting_since.pop(seq.seq_id, None)

    def requeue(self, seq: Sequence) -> None:
        """Send a running `seq` back to waiting with its blocks freed, to be recomputed (after
        a failed step whose KV writes cannot be trusted)."""
        if seq.status is SequenceStatus.RUNNING:
            self._preempt(seq)

    # ---- one step ---------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self.num_steps += 1
        budget = self.limits.max_num_batched_tokens
        chosen: dict[int, ScheduledSequence] = {}
        preempted = 0

        # Decodes first, then chunks; within each, in precedence order.
        decodes: list[Sequence] = []
        chunks: list[Sequence] = []
        for seq in self.running:
            pending = len(seq.token_ids) + seq.num_inflight - seq.num_computed_tokens
            if seq.num_inflight and self._ends_in_flight(seq):
                continue  # the token in flight ends it: nothing more to compute
            if pending == 1:
                decodes.append(seq)
            elif pending > 1:
                chunks.append(seq)
        for seq in decodes + chunks if chunks else decodes:
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = min(len(seq.token_ids) + seq.num_inflight - seq.num_computed_tokens, budget)
            if num_new <= 0:
                continue
            drafts = self._fitting_drafts(seq, budget) if num_new == 1 else ()
            drafts = () if seq.num_inflight else drafts
            if drafts and self.kv_cache.allocate_slots(seq, 1, num_lookahead=len(drafts)):
                chosen[seq.seq_id] = ScheduledSequence(
                    seq, seq.num_computed_tokens, 1 + len(drafts), True, drafts
                )
                budget -= 1 + len(drafts)
                continue
            while not self.kv_cache.allocate_slots(seq, num_new):
                victim = self.running[-1]
                refund = chosen.pop(victim.seq_id, None)
                if refund is not None:
                    budget += refund.num_tokens
                self._preempt(victim)
                preempted += 1
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            chosen[seq.seq_id] = ScheduledSequence(
                seq,
                seq.num_computed_tokens,
                num_new,
                seq.num_computed_tokens + num_new == seq.num_tokens + seq.num_inflight,
            )
            budget -= num_new

        # Admit waiting sequences only when memory is not already short.
        if not preempted and self.waiting:
            budget, preempted = self._admit(chosen, budget)

        for seq in self.running:
            if seq.draft_token_ids:
                seq.draft_token_ids = []  # proposed for this step only
        scheduled = list(chosen.values())
        if any(item.num_tokens > 1 for item in scheduled):
            scheduled.sort(key=lambda s: s.num_tokens > 1)
        finished, self._finished_ids = self._finished_ids, []
        return SchedulerOutput(
            scheduled=scheduled,
            num_batched_tokens=self.limits.max_num_batched_tokens - budget,
            finished_seq_ids=finished,
            num_preempted=preempted,
        )

    def update(
        self, output: SchedulerOutput, sampled: list[int]
    ) -> list[tuple[Sequence, list[int]]]:
        """Record the step's progress and the tokens sampled for entries with `sample` set,
        in order (`num_samples` rows each). Returns `(sequence, rows of sampled)` for each
        sequence that got tokens, one row per token appended (more than one where drafts were
        accepted); those that finished are freed."""
        row = 0
        updated = []
        self.verified = []
        for item in output.scheduled:
            seq = item.seq
            if not item.sample:
                if not seq.is_finished:  # else aborted while the step ran
                    seq.num_computed_tokens = item.start + item.num_tokens
                continue
            first = row
            row += len(item.drafts) + 1
            if seq.is_finished:
                continue  # aborted while the step ran
            if not item.drafts:
                token = sampled[first]
                seq.num_computed_tokens = item.start + item.num_tokens
                seq.append_token(token)
                self._check_stop(seq, token)
                updated.append((seq, [first]))
                continue
            accepted = _agreeing(item.drafts, sampled[first:row])
            seq.num_computed_tokens = item.start + item.num_tokens - len(item.drafts) + accepted
            rows = []
            for r in range(first, first + accepted + 1):
                seq.append_token(sampled[r])
                rows.append(r)
                self._check_stop(seq, sampled[r])
                if seq.is_finished:
                    break
            if item.drafts:
                seq.spec_proposed += len(item.drafts)
                seq.spec_accepted += accepted
                self.verified.append((len(item.drafts), accepted, len(rows)))
                if not seq.is_finished:
                    self.kv_cache.rollback(seq, item.start)
            updated.append((seq, rows))
        return updated

    # ---- asynchronous steps -----------------------------------------------------------
    # A step may be launched before the previous one's tokens reach the host (the engine's
    # `async_steps`): `advance` records a launched step of single-token decodes as if its
    # tokens were known (each sequence's next position computed, one token in flight), so
    # the next `schedule` can already give each sequence its following position; `resolve`
    # lands the tokens when they arrive. A sequence that a landed token ends was maybe
    # scheduled once more: that row is dropped when it lands (it is finished by then), its
    # KV written into blocks freed meanwhile, which later steps only reuse after it in the
    # device's order.

    def advance(self, output: SchedulerOutput) -> None:
        """`output` (single-token decodes only) was launched: its tokens are in flight."""
        for item in output.scheduled:
            seq = item.seq
            seq.num_computed_tokens = item.start + 1
            seq.num_inflight += 1

    def resolve(
        self, output: SchedulerOutput, sampled: list[int]
    ) -> list[tuple[Sequence, list[int]]]:
        """The tokens of an `advance`d step landed (one per entry, in order): append them and
        check stops, as `update` does. A sequence aborted, ended or preempted meanwhile keeps
        what it is owed: a finished one nothing, a preempted one its token (it was computed
        from its KV before the blocks were freed)."""
        updated = []
        self.verified = []
        for row, item in enumerate(output.scheduled):
            seq = item.seq
            seq.num_inflight -= 1
            if seq.is_finished:
                continue
            token = sampled[row]
            seq.append_token(token)
            self.kv_cache.register_filled(seq)
            self._check_stop(seq, token)
            updated.append((seq, [row]))
        return updated

    def _ends_in_flight(self, seq: Sequence) -> bool:
        """Whether `seq`'s tokens in flight reach its length limits (it ends when they land)."""
        total = len(seq.token_ids) + seq.num_inflight
        return total - seq.num_prompt_tokens >= seq.max_tokens or total >= self.limits.max_model_len

    # ---- helpers ----------------------------------------------------------------------
    def _fitting_drafts(self, seq: Sequence, budget: int) -> tuple[int, ...]:
        """The sequence's drafts that fit this step: its token budget, and room for every
        draft plus the target's own token within `max_tokens` and the context."""
        if not seq.draft_token_ids:
            return ()
        room = min(
            budget - 1,
            seq.max_tokens - seq.num_output_tokens - 1,
            self.limits.max_model_len - seq.num_tokens - 1,
        )
        return tuple(seq.draft_token_ids[: max(room, 0)])

    def _admit(self, chosen: dict[int, ScheduledSequence], budget: int) -> tuple[int, int]:
        """Admit waiting sequences in precedence order; one that outranks running sequences
        by a level preempts them for a seat, tokens or blocks. Returns the budget left and
        the number preempted."""
        self.waiting.sort(key=self._precedence)
        adapters = {s.adapter for s in self.running if s.adapter is not None}
        held_back = False
        admitted: set[int] = set()
        preempted = 0
        for seq in list(self.waiting):  # victims join the queue; they wait a step
            if seq.adapter is not None and seq.adapter not in adapters:
                if held_back or len(adapters) >= self.limits.max_loras:
                    held_back = True
                    continue
            elif seq.adapter is not None and held_back:
                continue
            while len(self.running) >= self.limits.max_num_seqs:
                victim = self._victim(seq, self.running)
                if victim is None:
                    break
                budget += self._preempt_scheduled(victim, chosen)
                preempted += 1
            # Prompt chunks of outranked sequences yield the step's tokens (their computed
            # blocks stay cached); decodes keep theirs, one token each.
            wanted = seq.num_tokens - seq.num_computed_tokens
            while budget < wanted:
                chunks = [c.seq for c in chosen.values() if c.num_tokens > 1]
                victim = self._victim(seq, chunks)
                if victim is None:
                    break
                budget += self._preempt_scheduled(victim, chosen)
                preempted += 1
            if budget <= 0 or len(self.running) >= self.limits.max_num_seqs:
                break
            # Looked up after any preemption: a victim's uncomputed blocks are forgotten.
            cached = self.kv_cache.find_cached_prefix(seq)
            num_new = min(seq.num_tokens - len(cached) * self.kv_cache.block_size, budget)
            # Short of blocks: preempt outranked sequences until they fit (the else clause),
            # or stop admitting when none is left (break).
            while not self.kv_cache.allocate_slots(seq, num_new, cached):
                victim = self._victim(seq, self.running)
                if victim is None:
                    break
                budget += self._preempt_scheduled(victim, chosen)
                preempted += 1
                cached = self.kv_cache.find_cached_prefix(seq)
                num_new = min(seq.num_tokens - len(cached) * self.kv_cache.block_size, budget)
            else:
                admitted.add(seq.seq_id)
                if seq.adapter is not None:
                    adapters.add(seq.adapter)
                self._start(seq)
                start = seq.num_computed_tokens
                chosen[seq.seq_id] = ScheduledSequence(
                    seq, start, num_new, start + num_new == seq.num_tokens
                )
                budget -= num_new
                continue
            break
        if admitted:
            self.waiting = [s for s in self.waiting if s.seq_id not in admitted]
        return budget, preempted

    def _victim(self, seq: Sequence, candidates: list[Sequence]) -> Sequence | None:
        """The candidate of lowest precedence, if waiting `seq` outranks it by a level."""
        if not candidates:
            return None
        lowest = max(candidates, key=self._precedence)
        return lowest if self._level(seq) < self._level(lowest) else None

    def _preempt_scheduled(self, seq: Sequence, chosen: dict[int, ScheduledSequence]) -> int:
        """Preempt running `seq`, dropping its part of this step; returns the tokens freed."""
        dropped = chosen.pop(seq.seq_id, None)
        self._preempt(seq)
        return dropped.num_tokens if dropped is not None else 0

    def _start(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.RUNNING
        self._waited[seq.seq_id] += self.num_steps - self._waiting_since.pop(seq.seq_id)
        bisect.insort(self.running, seq, key=self._precedence)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv_cache.free(seq)
        seq.num_computed_tokens = 0
        seq.draft_token_ids = []
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        self._waiting_since[seq.seq_id] = self.num_steps
        self.num_preemptions += 1

    def _level(self, seq: Sequence) -> int:
        """`seq`'s priority, less one per `priority_aging_steps` steps it spent waiting."""
        waited = self._waited.get(seq.seq_id, 0)
        since = self._waiting_since.get(seq.seq_id)
        if since is not None:
            waited += self.num_steps - since
        return aged_level(seq.priority, waited, self.limits.priority_aging_steps)

    def _precedence(self, seq: Sequence) -> tuple[int, int, int]:
        return (self._level(seq), seq.arrival, seq.seq_id)

    def _check_stop(self, seq: Sequence, token: int) -> None:
        params = seq.params
        num_tokens = len(seq.token_ids)
        produced = num_tokens - seq.num_prompt_tokens
        if produced >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                self.finish(seq, FinishReason.STOP)
                return
            if token in params.stop_token_ids:
                self.finish(seq, FinishReason.STOP, token)
                return
        if produced >= seq.max_tokens or num_tokens >= self.limits.max_model_len:
            self.finish(seq, FinishReason.LENGTH)


def _agreeing(drafts: tuple[int, ...], sampled: list[int]) -> int:
    """How many leading drafts equal the token the target sampled at their position."""
    accepted = 0
    for draft, token in zip(drafts, sampled, strict=False):
        if draft != token:
            break
        accepted += 1
    return accepted
