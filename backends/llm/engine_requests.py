"""The engine's requests: queued from any thread, held while their sequences run, and the
outputs their tokens make.

Contract: `EngineRequests` belongs to one `LLMEngine`. `add` and `abort` may be called from
any thread (each only appends to a deque, which is safe without a lock); everything else runs
on the engine thread, at step boundaries (`apply_aborts`, `apply_incoming`) or after a step's
tokens are recorded (`mark_scheduled`, `advance_guide`, `emit`). A request counts as in
flight for its LoRA adapter from `add` until it is retired (finished, aborted or failed).

`emit` turns a sequence's new tokens into a `RequestOutput`: the text delta from the
request's incremental detokenizer, cut at the first stop string (tokens after it are dropped,
as are drafts accepted past it), and the request's TTFT, inter-token and end-to-end latencies
observed on the engine's metrics.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

from backends.llm.detokenizer import IncrementalDetokenizer
from backends.llm.lora.manager import LoRAManager
from backends.llm.metrics import EngineMetrics
from backends.llm.outputs import RequestOutput
from backends.llm.scheduler import Scheduler, SchedulerOutput
from backends.llm.sequence import FinishReason, Logprob, Sequence
from backends.llm.structured.guide import TokenGuide

log = logging.getLogger(__name__)


@dataclass
class EngineRequest:
    request_id: str
    seqs: list[Sequence]
    arrival_time: float
    detokenizers: list[IncrementalDetokenizer | None]
    adapter: str | None = None
    scheduled_time: float | None = None
    first_token_time: float | None = None
    # Sequences whose final output was emitted.
    num_done: int = 0
    last_token_times: list[float] = field(default_factory=list)


class EngineRequests:
    """Requests added and not yet applied, aborts asked for, and the requests running."""

    def __init__(self, metrics: EngineMetrics, lora: LoRAManager) -> None:
        self.metrics = metrics
        self.lora = lora
        self.incoming: collections.deque[EngineRequest] = collections.deque()
        self.aborts: collections.deque[str] = collections.deque()
        # Ids aborted before their request was applied (or after it finished).
        self._aborted_early: set[str] = set()
        self.running: dict[str, EngineRequest] = {}
        # Requests not scheduled yet (their queue time is observed when they are).
        self._unscheduled: set[str] = set()

    # ---- any thread ---------------------------------------------------------------------
    def add(self, request: EngineRequest) -> None:
        self.incoming.append(request)

    def abort(self, request_id: str) -> None:
        self.aborts.append(request_id)

    def incoming_sequences(self) -> list[Sequence]:
        """The sequences of the requests added since the last step (not in the work the
        engine thread published yet)."""
        return [seq for r in list(self.incoming) for seq in r.seqs]

    # ---- the engine thread --------------------------------------------------------------
    def apply_incoming(self, scheduler: Scheduler) -> bool:
        """Hand the requests added since the last step to the scheduler; whether any was."""
        if not self.incoming and not self._aborted_early:
            return False
        while self.incoming:
            request = self.incoming.popleft()
            if request.request_id in self._aborted_early:
                self.retire(request)
                continue  # aborted before it ever ran
            self.running[request.request_id] = request
            self._unscheduled.add(request.request_id)
            request.last_token_times = [request.arrival_time] * len(request.seqs)
            self.metrics.observe_arrival(request.seqs[0].num_prompt_tokens)
            for seq in request.seqs:
                scheduler.add(seq)
        # An add always precedes its abort, so any id left here belonged to a request that
        # had already finished.
        self._aborted_early.clear()
        return True

    def apply_aborts(self, scheduler: Scheduler) -> bool:
        """Finish the sequences of the requests aborted since the last step; whether any
        abort was asked for."""
        if not self.aborts:
            return False
        while self.aborts:
            request_id = self.aborts.popleft()
            request = self.running.pop(request_id, None)
            if request is None:
                # Still incoming (skipped when applied) or already finished. The incoming
                # queue is never rebuilt here: another thread may be appending to it.
                self._aborted_early.add(request_id)
                continue
            self.end(request, scheduler)
        return True

    def mark_scheduled(self, output: SchedulerOutput, scheduled_at: float) -> None:
        """The step of `output` was scheduled at `scheduled_at`: the queue time of each
        request it schedules for the first time."""
        for item in output.scheduled if self._unscheduled else ():
            request = self.running.get(item.seq.request_id)
            if request is not None and request.scheduled_time is None:
                request.scheduled_time = scheduled_at
                self._unscheduled.discard(request.request_id)
                self.metrics.observe_latency("queue", scheduled_at - request.arrival_time)

    def advance_guide(
        self, scheduler: Scheduler, seq: Sequence, guide: TokenGuide, rows: list[int]
    ) -> list[int]:
        """Feed the step's tokens (one per row of `rows`) to the sequence's grammar; a
        complete grammar ends it, and tokens after that are dropped. A token that finished
        the sequence otherwise (eos, a stop token) is not fed. Returns the rows kept."""
        start = seq.num_tokens - len(rows)
        for i in range(len(rows)):
            if seq.is_finished and start + i == seq.num_tokens - 1:
                break
            if not guide.accept(seq.token_ids[start + i]):
                # Only a bug lets a masked-out token through; end the sequence, not the engine.
                log.error("request %s left its grammar: %s", seq.request_id, guide.error)
            elif not guide.is_done:
                continue
            truncate(scheduler, seq, start + i + 1, FinishReason.STOP, None)
            return rows[: i + 1]
        return rows

    def emit(
        self, scheduler: Scheduler, seq: Sequence, logprobs: list[Logprob | None], now: float
    ) -> RequestOutput:
        """The output of the step's tokens of `seq` (the last `len(logprobs)`), cut at the
        first stop string."""
        request = self.running[seq.request_id]
        start = seq.num_tokens - len(logprobs)
        tokens = seq.token_ids[start:]
        text = ""
        detokenizer = request.detokenizers[seq.index]
        if detokenizer is not None:
            for i, token in enumerate(tokens):
                piece, stop = detokenizer.push([token])
                text += piece
                if stop is not None:
                    if i + 1 < len(tokens) or not seq.is_finished:
                        truncate(scheduler, seq, start + i + 1, FinishReason.STOP, stop)
                        tokens, logprobs = tokens[: i + 1], logprobs[: i + 1]
                    break
            if seq.is_finished:
                text += detokenizer.flush()
        if seq.num_output_tokens > 1:
            self.metrics.observe_latency("itl", now - request.last_token_times[seq.index])
        elif request.first_token_time is None:
            request.first_token_time = now
            self.metrics.observe_latency("ttft", now - request.arrival_time)
        request.last_token_times[seq.index] = now
        if seq.is_finished:
            request.num_done += 1
            if request.num_done == len(request.seqs):
                self.retire(self.running.pop(seq.request_id))
                self.metrics.observe_latency("e2e", now - request.arrival_time)
        return RequestOutput(
            request_id=seq.request_id,
            index=seq.index,
            token_ids=tokens,
            text=text,
            logprobs=[lp for lp in logprobs if lp is not None],
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            num_output_tokens=seq.num_output_tokens,
        )

    def end(self, request: EngineRequest, scheduler: Scheduler) -> None:
        """Abort a request already taken out of `running`: its sequences finish, their blocks
        go back, and it is retired."""
        self.retire(request)
        for seq in request.seqs:
            scheduler.finish(seq, FinishReason.ABORT)

    def end_all(self, scheduler: Scheduler) -> list[str]:
        """Abort every running request (after a failed step); returns their ids."""
        ended = list(self.running)
        requests: Iterable[EngineRequest] = list(self.running.values())
        self.running.clear()
        for request in requests:
            for seq in request.seqs:
                scheduler.finish(seq, FinishReason.ABORT)
        for request in requests:
            self.retire(request)
        return ended

    def retire(self, request: EngineRequest) -> None:
        """The request left the engine (finished, aborted, failed): its adapter may unload."""
        self._unscheduled.discard(request.request_id)
        if request.adapter is not None:
            self.lora.release(request.adapter)


def truncate(
    scheduler: Scheduler, seq: Sequence, num_tokens: int, reason: FinishReason, stop: str | None
) -> None:
    """End `seq` with its first `num_tokens` tokens (drafts accepted past a stop point are
    dropped)."""
    scheduler.finish(seq, reason, stop)
    seq.finish(reason, stop)  # where an earlier token than the one that ended it stops
    del seq.token_ids[num_tokens:]
