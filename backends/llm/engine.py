"""The engine's step loop: schedule, run, update, detokenize. Synchronous, one thread.

    output = scheduler.schedule()
    sampled = runner.execute(output)
    scheduler.update(output, sampled)

`add_request` and `abort_request` may be called from any thread: they validate (raising
`InputError` / `CapacityError` before anything changes) and queue the change, which the next
`step` applies. A request may name a LoRA adapter loaded on the runner (`runner.lora`); it
counts as in flight for that adapter from `add_request` until it finishes or is aborted.
Everything else belongs to the thread that calls `step`. The engine works on token ids;
with a tokenizer it also produces text deltas and honours stop strings (the requests and
their outputs: `backends.llm.engine_requests`).

With speculative decoding configured (`EngineConfig.speculative`), a `Speculator` drafts
tokens for decoding sequences before each schedule; a step may then give a sequence several
tokens, emitted as one output and cut at a stop string or a finished grammar.

With `EngineConfig.async_steps`, a step of greedy decodes may be launched before the previous
one's tokens are on the host:

    output = scheduler.schedule()         # each sequence counted a token ahead
    launched = launcher.launch(output, step, in_flight)   # in-flight inputs fed on the device
    scheduler.advance(output)
    scheduler.resolve(in_flight.output, launcher.collect(in_flight))   # the previous one lands

(`backends.llm.launch_ahead`), and `step` returns the landed step's outputs.
`_may_launch_ahead` says when (see docs/engine.md, "Decode steps on a GPU"); any other step
lands the one in flight first.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any

from backends.errors import CapacityError, InputError, TransientError
from backends.llm.config import EngineConfig
from backends.llm.detokenizer import IncrementalDetokenizer
from backends.llm.engine_requests import EngineRequest, EngineRequests
from backends.llm.engine_work import EngineWork
from backends.llm.isolation import RequestFailedError, blame_is_attributable, find_culprits
from backends.llm.kv_cache_manager import KVCacheManager
from backends.llm.launch_ahead import Inflight, Launcher, unfinished
from backends.llm.metrics import EngineMetrics
from backends.llm.model_runner import ModelRunner
from backends.llm.outputs import EngineStepError, RequestOutput
from backends.llm.request_limits import RequestLimits, checked_max_tokens
from backends.llm.sampling_params import MAX_COUNT, SamplingParams
from backends.llm.scheduler import Scheduler, SchedulerLimits, SchedulerOutput
from backends.llm.sequence import ROOT_HASH, Logprob, Sequence
from backends.llm.speculative.speculator import Proposer, Speculator
from backends.llm.structured.compiler import GrammarCompiler
from backends.llm.structured.guide import TokenGuide
from backends.llm.structured.metrics import GrammarMetrics

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        runner: ModelRunner,
        tokenizer: Any | None = None,
        metrics: EngineMetrics | None = None,
        grammar_metrics: GrammarMetrics | None = None,
        proposer: Proposer | None = None,
    ) -> None:
        """`proposer` drafts tokens for speculative decoding (a draft model's); None: prompt
        lookup where `config.speculative` asks for speculation."""
        self.config = config
        self.runner = runner
        self.tokenizer = tokenizer
        self.metrics = metrics or EngineMetrics.disabled()
        self.max_model_len = runner.max_model_len
        self.max_tokens_limit = min(
            config.max_tokens_limit or self.max_model_len, self.max_model_len
        )
        self.limits = RequestLimits(
            vocab_size=runner.vocab_size,
            max_model_len=self.max_model_len,
            max_tokens_limit=self.max_tokens_limit,
            max_n=config.max_n,
            max_logprobs=config.max_logprobs,
            default_max_tokens=config.default_max_tokens,
        )
        self._seq_ids = itertools.count()
        self.requests = EngineRequests(self.metrics, runner.lora)
        # Whether `work` was published after the scheduler last changed.
        self._published = False
        # The measured step cost and the outstanding work: admission by queue time here,
        # and this engine's share of its device's work (the backend counts it there).
        self.work = EngineWork(
            config.max_queue_time_s,
            self.requests.incoming_sequences,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
        )
        # Structured outputs need the tokenizer (a grammar speaks in text).
        self.grammars = (
            GrammarCompiler(
                tokenizer, runner.vocab_size, runner.sampler.eos_token_ids, grammar_metrics
            )
            if tokenizer is not None
            else None
        )
        self.speculator = (
            Speculator(config.speculative, proposer) if config.speculative is not None else None
        )
        fused = getattr(runner, "fused", None)
        if fused is not None and self.metrics.enabled:
            fused.thread_choice.on_step = self.metrics.observe_fused_step
        # The step launched and not landed yet (`async_steps`), and when the last one landed.
        self._inflight: Inflight | None = None
        self._landed_at = 0.0
        self.launcher = Launcher(runner)
        self.reset_cache()

    def reset_cache(self) -> None:
        """A fresh block pool and scheduler over the runner's (new) KV cache; no request
        may be in flight."""
        self.kv_cache = KVCacheManager(
            self.runner.num_blocks,
            self.config.block_size,
            enable_prefix_caching=self.config.enable_prefix_caching,
        )
        limits = SchedulerLimits(
            max_num_seqs=self.config.max_num_seqs,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            priority_aging_steps=self.config.priority_aging_steps,
            max_loras=self.config.max_loras,
        )
        self.scheduler = Scheduler(limits, self.kv_cache, self.runner.sampler.eos_token_ids)
        self._published = False

    def cache_replaced(self) -> None:
        """The runner's KV cache was allocated anew (a restore): the block pool and the
        scheduler stay as they are (their plan does not depend on where the cache lives),
        but no block holds its KV any more, so the prefix cache forgets every block. No
        request may be in flight (RuntimeError otherwise)."""
        if self.has_work():
            raise RuntimeError("the KV cache was replaced under requests in flight")
        self.kv_cache.reset_prefix_cache()

    # ---- requests (any thread) ----------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        adapter: str | None = None,
    ) -> None:
        """Validate and queue a request; InputError / CapacityError leave no trace.
        `adapter`: a LoRA adapter loaded on the runner, None for the base model."""
        if isinstance(priority, bool) or not isinstance(priority, int) or abs(priority) > MAX_COUNT:
            raise InputError(
                f"priority must be an integer in [-{MAX_COUNT}, {MAX_COUNT}]", param="priority"
            )
        max_tokens = self.check_request(prompt_token_ids, params)
        if len(self.requests.incoming) + self.scheduler.num_unfinished >= self.config.max_waiting:
            self.metrics.observe_shed("queue_full")
            raise CapacityError(
                f"{self.config.max_waiting} sequences are already queued or running; retry later"
            )
        try:
            self.work.admit(params.n, len(prompt_token_ids), max_tokens)
        except CapacityError:
            self.metrics.observe_shed("queue_time")
            raise
        root_hash = ROOT_HASH
        if adapter is not None:
            root_hash = self.runner.lora.peek(adapter)  # InputError for an unknown one
        seqs = [
            Sequence(
                next(self._seq_ids),
                request_id,
                prompt_token_ids,
                params,
                max_tokens=max_tokens,
                block_size=self.config.block_size,
                index=i,
                priority=priority,
                adapter=adapter,
                root_hash=root_hash,
            )
            for i in range(params.n)
        ]
        if params.structured is not None:
            if self.grammars is None:
                raise InputError(
                    "structured outputs need the model's tokenizer", param="response_format"
                )
            for seq in seqs:  # each sample walks the grammar on its own
                matcher = self.grammars.matcher(params.structured)
                seq.guide = TokenGuide(matcher, self.runner.vocab_size)
        detokenizers: list[IncrementalDetokenizer | None] = [
            IncrementalDetokenizer(
                self.tokenizer,
                prompt_token_ids,
                stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output,
                skip_special_tokens=params.skip_special_tokens,
            )
            if self.tokenizer is not None
            else None
            for _ in seqs
        ]
        request = EngineRequest(request_id, seqs, time.monotonic(), detokenizers, adapter)
        if adapter is not None and self.runner.lora.acquire(adapter) != root_hash:
            self.runner.lora.release(adapter)
            # A race with a reload of the adapter, not the caller's mistake: 503, retry.
            raise TransientError(f"adapter {adapter!r} was reloaded meanwhile; retry")
        self.requests.add(request)

    def abort_request(self, request_id: str) -> None:
        """Finish the request's sequences at the next step boundary, freeing their blocks."""
        self.requests.abort(request_id)

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Raise InputError for a request this engine cannot serve; return its max_tokens."""
        return checked_max_tokens(prompt_token_ids, params, self.limits)

    # ---- the loop (engine thread) ------------------------------------------------------
    @property
    def in_flight(self) -> bool:
        """Whether a step was launched and its tokens have not landed (`async_steps`)."""
        return self._inflight is not None

    def has_work(self) -> bool:
        return bool(
            self.requests.incoming
            or self.requests.aborts
            or self.scheduler.num_unfinished
            or self._inflight is not None
        )

    def step(self) -> list[RequestOutput]:
        """One engine step; outputs for every sequence that got a token or finished. With
        `async_steps`, a step of greedy decodes is launched and the outputs returned are
        those of the step launched before it (see `_may_launch_ahead`)."""
        requests, scheduler = self.requests, self.scheduler
        changed = requests.apply_aborts(scheduler) | requests.apply_incoming(scheduler)
        inflight = self._inflight
        if inflight is not None and not self._may_launch_ahead():
            self._inflight = None
            return self._land(inflight)
        marks = self._marks()
        if changed or not self._published:
            self.work.publish(itertools.chain(scheduler.waiting, scheduler.running))
        self._published = False
        step_clock = self.work.step_started = self.work.clock()
        started = time.monotonic()
        if self.speculator is not None:
            self.speculator.propose(scheduler.running)
        output = scheduler.schedule()
        scheduled_at = time.monotonic()
        static = None
        if self.config.async_steps and self.speculator is None:
            static = self.launcher.static_step(output)
        if static is not None:
            previous = None if inflight is None else inflight.launched
            try:
                launched = self.launcher.launch(output, static, previous)
            except Exception as e:
                raise self._async_failed(e) from e
            scheduler.advance(output)
            self._inflight = Inflight(output, launched, started, scheduled_at, marks)
            if inflight is None:
                return []
            landed = self._land(inflight)
            self.work.step_started = step_clock  # the step just launched is running
            return landed
        landed = []
        if inflight is not None:  # it could not launch after all: land the one in flight
            self._inflight = None
            landed = self._land(inflight)
            self.work.step_started = step_clock
            output = unfinished(output)
            # Blocks whose last token was in flight when they were allocated get their hash
            # only now: register those this step computes.
            for item in output.scheduled:
                self.kv_cache.register_computed(item.seq, item.start, item.start + item.num_tokens)
            if output.is_empty:
                self.work.step_started = None
                return landed
        try:
            sampled = self.runner.execute(output)
        except Exception as e:
            self.work.step_started = None
            raise self._recover(output, e) from e
        updated = scheduler.update(output, sampled.token_ids)
        for proposed, accepted, emitted in scheduler.verified:
            self.metrics.speculation.observe(proposed, accepted, emitted)
        for i, (seq, rows) in enumerate(updated):
            if seq.guide is not None:
                updated[i] = (seq, requests.advance_guide(scheduler, seq, seq.guide, rows))
        if self.speculator is not None:
            self.speculator.observe(output, updated)
        elapsed = time.monotonic() - started
        return landed + self._complete(output, updated, sampled.logprobs, elapsed, scheduled_at,
                                       marks)  # fmt: skip

    def _may_launch_ahead(self) -> bool:
        """With a step in flight: whether the next one can be scheduled before its tokens
        land. Only decodes of greedy sequences that need no host state after a token (no
        grammar, penalties, logprobs, adapter or drafts), and nothing waiting to start, so
        that the scheduler gives every running sequence exactly its next position."""
        scheduler = self.scheduler
        if scheduler.waiting or self.requests.incoming or self.speculator is not None:
            return False
        return self.launcher.may_continue(scheduler.running)

    def _land(self, inflight: Inflight) -> list[RequestOutput]:
        """Wait for a launched step's tokens and record them (its outputs). Its time is from
        its launch, or from the previous landing where that came later (the steps overlap:
        in steady state a step takes the time between two landings)."""
        output = inflight.output
        try:
            tokens = self.launcher.collect(inflight.launched)
        except Exception as e:
            self._inflight = None
            raise self._async_failed(e) from e
        updated = self.scheduler.resolve(output, tokens)
        now = time.monotonic()
        elapsed = now - max(inflight.started, self._landed_at)
        self._landed_at = now
        logprobs: list[Logprob | None] = [None] * len(tokens)
        return self._complete(
            output, updated, logprobs, elapsed, inflight.scheduled_at, inflight.marks
        )

    def _async_failed(self, error: Exception) -> EngineStepError:
        """A step launched ahead failed, at its launch or its landing. Every input of such a
        step was checked on arrival and its rows are plain decodes, so the failure is the
        device's, not a request's: every request fails, as an unattributable synchronous
        failure does (their tokens in flight are lost)."""
        self._inflight = None
        self.work.step_started = None
        for seq in self.scheduler.running:
            seq.num_inflight = 0
        return EngineStepError(self._fail_all(), error)

    def _marks(self) -> tuple[int, int, int]:
        """Counters a step's metrics report the growth of: prefix queries and hits, LoRA
        slot loads."""
        kv = self.kv_cache
        return kv.prefix_queries, kv.prefix_hits, self.runner.lora.slot_loads

    def _complete(
        self,
        output: SchedulerOutput,
        updated: list[tuple[Sequence, list[int]]],
        logprobs: list[Logprob | None],
        elapsed: float,
        scheduled_at: float,
        marks: tuple[int, int, int],
    ) -> list[RequestOutput]:
        """After a step's tokens are recorded (it took `elapsed` seconds): its latencies,
        outputs, work and metrics."""
        scheduler = self.scheduler
        now = time.monotonic()
        self.requests.mark_scheduled(output, scheduled_at)
        emit = self.requests.emit
        outputs = [emit(scheduler, seq, [logprobs[row] for row in rows], now)
                   for seq, rows in updated]  # fmt: skip
        self.work.observe_step(output.num_batched_tokens, elapsed, sequences=len(output.scheduled))
        self.work.publish(itertools.chain(scheduler.waiting, scheduler.running))
        self._published = True
        self.work.step_started = None
        if self.metrics.enabled:
            queries, hits, slot_loads = marks
            lora = self.runner.lora
            self.metrics.observe_step(
                running=len(scheduler.running),
                waiting=len(scheduler.waiting),
                kv_usage=self.kv_cache.usage,
                prefix_queries=self.kv_cache.prefix_queries - queries,
                prefix_hits=self.kv_cache.prefix_hits - hits,
                generated=sum(len(rows) for _, rows in updated),
                preempted=output.num_preempted,
                lora_slots=lora.slots_in_use,
                lora_slot_loads=lora.slot_loads - slot_loads,
            )
        return outputs

    def _recover(self, output: SchedulerOutput, error: Exception) -> EngineStepError:
        """After a failed step: end the requests to blame alone when there are such (see
        backends.llm.isolation), else every request. The step's other sequences go back to
        waiting and are recomputed: the blocks this step registered were never written, and
        a neighbour may already share them through the prefix cache, which is therefore reset.
        (A seeded neighbour may then sample differently than it would have.)"""
        culprits = find_culprits(self.runner, output)
        if not blame_is_attributable(culprits, output):
            return EngineStepError(self._fail_all(), error)
        errors: dict[str, BaseException] = {}
        for request_id, cause in culprits.items():
            request = self.requests.running.pop(request_id, None)
            if request is None:
                continue
            self.requests.end(request, self.scheduler)
            errors[request_id] = RequestFailedError(request_id, cause)
        for item in output.scheduled:
            if not item.seq.is_finished:
                self.scheduler.requeue(item.seq)
        self.kv_cache.reset_prefix_cache()
        return EngineStepError(list(errors), error, errors)

    def _fail_all(self) -> list[str]:
        """After a failed step: end every request and forget cached blocks (their contents
        are undefined), so the engine can serve new requests. Returns the ended ids."""
        log.exception("LLM engine step failed; aborting %d requests", len(self.requests.running))
        failed = self.requests.end_all(self.scheduler)
        self.kv_cache.reset_prefix_cache()
        return failed
