"""The work an LLM engine has outstanding, as its admission and its device see it.

An encoder's queue holds inputs of a known cost; an engine holds sequences, each with prompt
tokens still to prefill and up to `max_tokens` still to generate, run together in steps.
Decodes of different sequences share a step (up to `max_num_seqs` of them: its seats), prompt
tokens fill what a step's token budget (`max_num_batched_tokens`) leaves after the decodes,
and one sequence's tokens are generated one step after another (a sequence may generate up
to its `max_tokens`: the bound its request set; one that stops early frees its seat sooner).

With continuous batching a new request does not wait for the others' generations: it joins
the running batch at the next step that has a seat and budget for it. So the wait that
admission bounds (`max_queue_time_s`) is the time until the request's first step:

    wait = what is left of the step in flight
           + (steps until a seat is free + prompt tokens ahead / budget left by decodes)
             x the measured seconds per step

where a seat is free at once while fewer sequences than `max_num_seqs` run or wait ahead,
and otherwise when the running sequences (one token a step each) and the waiting ones ahead
(taking the seats in order) have finished enough of their generations. A step's time grows
with the sequences sharing it, so the whole latency is bounded too: the request's own
`max_tokens` steps run at the step time of the batch it makes (`step_at`: the sequences
running, waiting and reserved, and its own, up to the seats), `max_tokens x (step_at(batch)
- step_at(1))` slower than alone; admission refuses a request whose wait plus that is over
`max_queue_time_s`, or whose joining would slow the batch's longest generation by more.
`step_at` is measured per batch size (buckets by powers of two); a batch larger than any
measured is priced as the largest measured one grown in proportion (no fixed cost: an
upper bound while a sequence's share of a step does not grow with the batch), so a burst is
admitted a few at a time while larger batches are measured, not at a quiet step's cost.

The seconds per step are an exponentially weighted average of the measured steps
(`observe_step`), or what the step in flight has taken so far when that is already well over
the average (a burst contends for the device at once, long before the steps' end teaches the
average). The engine thread publishes its sequences at its step boundaries (`publish`);
requests added since are read through the `incoming` callable the engine gives (their
sequences, from its incoming queue).

Contract: `admit(size, prompt_tokens, max_tokens)` raises `CapacityError` when the wait of a
new request on its device (as above, plus the other models' work there, each counted up to
that wait: models on one device share it, so another model's backlog delays this request by
at most as much as this request waits for its own engine's work) is over
`max_queue_time_s`, or that wait plus its own slowdown in the batch it makes is, or when
its joining would slow the batch's longest generation by more than that,
naming the estimate, its parts and the bound, with a `retry_after` of about the time the
excess needs and that time as `saturated_s` (the HTTP edge refuses the model's next requests
at once until then). `reserve()` makes the same check before a request is tokenized and
counts it until `unreserve()` (as the average admitted request), so that a burst is refused
before its prompts are tokenized rather than after. Nothing is refused until a step was
measured, and an engine with nothing outstanding admits a request whatever the others have
(no model starves behind another's steady load), as the encoders' admission does
(backends/admission.py). `outstanding_s()` (all the steps the engine's work needs, in
seconds: what the other models on the device count) reads published numbers only: any
thread may call it.
"""

from __future__ import annotations

import heapq
import math
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from backends.admission import EWMA_ALPHA, DeviceWork
from backends.errors import CapacityError
from backends.llm.sequence import SequenceStatus

# A step in flight that has taken more than this many times the average reprices the work at
# once (the device is contended now: the average learns it only as steps end).
SLOW_STEP = 1.5

if TYPE_CHECKING:
    from backends.llm.sequence import Sequence


@dataclass(frozen=True)
class Work:
    """Sequences' work: prompt tokens to prefill, tokens they may still generate (in all,
    and the most one of them may), how many sequences, and the tokens left to generate of
    each running one (each holds a seat) and of each waiting one, in the order they take
    seats."""

    prefill: float = 0.0
    generate: float = 0.0
    longest: float = 0.0
    sequences: float = 0.0
    running: tuple[float, ...] = ()
    waiting: tuple[float, ...] = ()

    def __add__(self, other: Work) -> Work:
        return Work(
            self.prefill + other.prefill,
            self.generate + other.generate,
            max(self.longest, other.longest),
            self.sequences + other.sequences,
            self.running + other.running,
            self.waiting + other.waiting,
        )

    def __bool__(self) -> bool:
        return self.sequences > 0

    @classmethod
    def of(cls, sequences: Iterable[Sequence]) -> Work:
        prefill = generate = longest = count = 0
        running: list[float] = []
        waiting: list[float] = []
        is_running = SequenceStatus.RUNNING
        for seq in sequences:
            # Once a token was sampled, the last one is computed by the next decode: only
            # the rest (what a preemption dropped) is prefilled. (Attributes read directly:
            # this runs over every sequence twice a step.)
            tokens = len(seq.token_ids)
            produced = tokens - seq.num_prompt_tokens
            pending = tokens - seq.num_computed_tokens
            prefill += pending if produced == 0 else max(0, pending - 1)
            left = seq.max_tokens - produced
            if left < 0:
                left = 0
            generate += left
            if left > longest:
                longest = left
            count += 1
            (running if seq.status is is_running else waiting).append(left)
        return cls(prefill, generate, longest, count, tuple(running), tuple(waiting))


def steps_to_a_seat(running: Iterable[float], waiting: Iterable[float], seats: int) -> float:
    """Steps until one more sequence gets one of `seats`: each running sequence holds its
    seat for the tokens it has left (one a step), the waiting ones take the seats that free
    in order and hold them for theirs."""
    ends = sorted(running)  # a sorted list is a heap
    free = seats - len(ends)
    for tokens in waiting:
        if free > 0:
            free -= 1
            heapq.heappush(ends, tokens)
        else:
            heapq.heappush(ends, heapq.heappop(ends) + tokens)
    return 0.0 if free > 0 else ends[0]


class EngineWork:
    """One engine's measured step cost and published outstanding work. `max_queue_time_s`
    None: never refuses, only measures and publishes. `incoming`: the sequences of the
    requests added since the last publication (any thread may call it; it must not block).
    `max_num_seqs` and `max_num_batched_tokens` are the engine's step limits."""

    def __init__(
        self,
        max_queue_time_s: float | None,
        incoming: Callable[[], list[Sequence]] = list,
        *,
        max_num_seqs: int = 1,
        max_num_batched_tokens: int = 1,
        name: str = "this LLM",
        alpha: float = EWMA_ALPHA,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_queue_time_s is not None and max_queue_time_s < 0:
            raise ValueError("max_queue_time_s must be >= 0")
        self.max_queue_time_s = max_queue_time_s
        self._incoming = incoming
        self.max_num_seqs = max(1, max_num_seqs)
        self.max_num_batched_tokens = max(1, max_num_batched_tokens)
        self.name = name
        self._alpha = alpha
        self._step_s: float | None = None
        # Per batch-size bucket (the bit length of a step's sequences: 1, 2-3, 4-7, ...),
        # exponentially weighted (sequences, seconds) of the steps measured there; replaced,
        # never mutated, by the engine thread.
        self._buckets: dict[int, tuple[float, float]] = {}
        self.clock = clock
        # When the step in flight began (`clock`), None between steps; set by the engine
        # thread, read by any.
        self.step_started: float | None = None
        # Published by the engine thread, one object per publication; read by any thread.
        self.published = Work()
        # Requests checked before tokenizing and not yet added (`reserve`), counted as the
        # average admitted request; touched on the event loop only.
        self.reserved = 0
        self._average: Work | None = None
        self._device: DeviceWork | None = None
        self._token: int | None = None

    # ---- measurement (engine thread) ---------------------------------------------------
    def observe_step(self, tokens: int, seconds: float, *, sequences: int = 1) -> None:
        """A step ran `tokens` tokens (prefill chunks and decodes) of `sequences` sequences
        in `seconds`."""
        if tokens < 1 or not math.isfinite(seconds) or seconds < 0:
            return
        if self._step_s is None:
            self._step_s = seconds
        else:
            self._step_s += self._alpha * (seconds - self._step_s)
        key = max(1, sequences).bit_length()
        n, mean = float(max(1, sequences)), self._buckets.get(key)
        if mean is not None:
            a, (mean_n, mean_s) = self._alpha, mean
            n, seconds = mean_n + a * (n - mean_n), mean_s + a * (seconds - mean_s)
        # A new mapping each time: other threads read the one they got without a lock.
        self._buckets = {**self._buckets, key: (n, seconds)}

    def publish(self, sequences: Iterable[Sequence]) -> None:
        """The unfinished sequences now (the scheduler's waiting and running ones)."""
        self.published = Work.of(sequences)

    @property
    def step_s(self) -> float | None:
        """The measured seconds per step, or None before a step was measured."""
        return self._step_s

    def step_at(self, sequences: int) -> float:
        """Seconds a step that `sequences` sequences share takes (0 before a step was
        measured): the nearest measured bucket at or under its size, grown in proportion
        where `sequences` is over that bucket's average, but no more than the nearest
        measured larger batch takes; a batch smaller than any measured, the smallest
        measured one's time."""
        buckets = self._buckets
        if not buckets:
            return 0.0
        n = max(1, sequences)
        below = [b for b in buckets if b <= n.bit_length()]
        above = [b for b in buckets if b > n.bit_length()]
        cap = buckets[min(above)][1] if above else math.inf
        if not below:
            return cap
        mean_n, mean_s = buckets[max(below)]
        return min(cap, mean_s * max(1.0, n / mean_n))

    def slower_per_step_s(self, sequences: int) -> float:
        """How much longer a step that `sequences` share takes than one sequence's alone."""
        return max(0.0, self.step_at(sequences) - self.step_at(1))

    def step_cost(self) -> float | None:
        """What a step costs now: the average, or what the step in flight has taken so far
        where that is over SLOW_STEP times the average; None before a step was measured."""
        average, started = self._step_s, self.step_started
        if average is None or started is None:
            return average
        elapsed = self.clock() - started
        return elapsed if elapsed > SLOW_STEP * average else average

    def step_left(self, step_s: float) -> float:
        """What is left of the step in flight at `step_s` seconds a step (0 between steps)."""
        started = self.step_started
        return 0.0 if started is None else max(0.0, step_s - (self.clock() - started))

    # ---- the estimate (any thread) -----------------------------------------------------
    def outstanding(self) -> Work:
        """The work this engine holds: published, incoming and reserved (each reserved
        request waiting as the average admitted one)."""
        work = self.published + Work.of(self._incoming())
        if self.reserved and self._average is not None:
            average, n = self._average, self.reserved
            seats = max(1, round(average.sequences)) * n
            work += Work(
                average.prefill * n,
                average.generate * n,
                average.longest,
                average.sequences * n,
                waiting=(average.longest,) * seats,
            )
        return work

    def steps(self, work: Work) -> float:
        """Steps `work` needs at least, at the engine's step limits."""
        decode = max(work.longest, work.generate / self.max_num_seqs)
        return decode + work.prefill / self.max_num_batched_tokens

    def outstanding_s(self) -> float:
        """Seconds this engine needs for the work it holds (0 until a step was measured)."""
        step_s = self.step_cost()
        return 0.0 if step_s is None else self.steps(self.outstanding()) * step_s

    def steps_ahead(self, work: Work) -> tuple[float, float]:
        """(steps until a new sequence has a seat, steps of prompt tokens ahead of it): the
        prompt tokens of `work` over what the step's token budget leaves after the running
        sequences' decodes."""
        seat = steps_to_a_seat(work.running, work.waiting, self.max_num_seqs)
        decodes = min(len(work.running), self.max_num_seqs)
        return seat, work.prefill / max(1, self.max_num_batched_tokens - decodes)

    def sharing(self, work: Work, size: int) -> int:
        """Sequences that would share a step once `size` more joined `work`."""
        return min(self.max_num_seqs, len(work.running) + len(work.waiting) + size)

    def slowdown_s(self, work: Work, size: int, max_tokens: float) -> float:
        """How much longer than alone the longest generation among `work` and `size` more
        sequences of up to `max_tokens` would take, all of them sharing each step."""
        longest = max(work.longest, max_tokens)
        return self.slower_per_step_s(self.sharing(work, size)) * longest

    def count_on(self, device_work: DeviceWork | None) -> None:
        """Count this engine's work on `device_work` (the device it now runs on) instead of
        the previous one's; None: nowhere (offloaded or unloaded)."""
        if self._device is not None and self._token is not None:
            self._device.unregister(self._token)
        self._device, self._token = None, None
        if device_work is None:
            return
        # By weak reference: an engine dropped without an unload (a test's, a failed load's)
        # leaves the device's count, and the device does not keep its weights alive.
        ref = weakref.ref(self)

        def outstanding_s() -> float:
            work = ref()
            return 0.0 if work is None else work.outstanding_s()

        token = self._token = device_work.register(outstanding_s)
        self._device = device_work
        weakref.finalize(self, device_work.unregister, token)

    # ---- admission (event loop) ------------------------------------------------------------
    def reserve(self) -> None:
        """Check a request before it is tokenized (CapacityError as `admit`, as the average
        admitted request), and count it as that until `unreserve`: tokenizing takes the
        request off the event loop, and a burst's requests would otherwise all pass this
        check before the first of them is added."""
        self._check(1, 0.0 if self._average is None else self._average.longest)
        self.reserved += 1

    def unreserve(self) -> None:
        """A reserved request was tokenized (`admit` checks it again as it is added) or
        failed."""
        self.reserved = max(0, self.reserved - 1)

    def admit(self, size: int, prompt_tokens: int, max_tokens: int) -> None:
        """Admit a request of `size` sequences of `prompt_tokens` and up to `max_tokens`
        each, or raise CapacityError (naming the estimate) when it would wait too long for
        its first step on its device, or slow the running batch too much."""
        self._check(size, max_tokens)
        work = Work(size * prompt_tokens, size * max_tokens, max_tokens, size)
        if self._average is None:
            self._average = work
            return
        a, old = self._alpha, self._average
        self._average = Work(
            old.prefill + a * (work.prefill - old.prefill),
            old.generate + a * (work.generate - old.generate),
            old.longest + a * (work.longest - old.longest),
            old.sequences + a * (work.sequences - old.sequences),
        )

    def _check(self, size: int, max_tokens: float) -> None:
        bound = self.max_queue_time_s
        average = self.step_cost()
        if bound is None or average is None:
            return
        work = self.outstanding()
        if not work:
            return
        # The steps ahead run at the batch there is now, the request's own at the one it makes.
        step_s = max(average, self.step_at(self.sharing(work, 0)))
        sharing = self.sharing(work, size)
        per_step = self.slower_per_step_s(sharing)
        left = self.step_left(step_s)
        seat, prefill = self.steps_ahead(work)
        own = left + (seat + prefill) * step_s
        elsewhere = 0.0
        if self._device is not None:
            elsewhere = self._device.outstanding_s(excluding=self._token, within=own)
        wait = own + elsewhere
        latency = wait + per_step * max_tokens
        slowdown = self.slowdown_s(work, size, max_tokens)
        if latency <= bound and slowdown <= bound:
            return
        tokenizing = f", {self.reserved} being tokenized" if self.reserved else ""
        batch = (
            f"{sharing} sequences would share each step{tokenizing}, a step "
            f"{per_step * 1000:.1f} ms longer than one sequence's alone (at "
            f"{self.step_at(sharing) * 1000:.1f} ms against {self.step_at(1) * 1000:.1f} ms "
            "measured)"
        )
        if wait > bound:
            excess = wait - bound
            # Arrivals only add to the work: it stays over the bound at least this long,
            # unless this engine's own work ends first (then the next request is admitted).
            saturated = min(excess, own)
            why = (
                f"an estimated {wait:.2f}s of work is ahead of this request ({size} "
                f"sequences) on its device before its first step ({own:.2f}s of this LLM's: "
                f"{left * 1000:.1f} ms left of the step running, {seat:.1f} steps until one "
                f"of its {self.max_num_seqs} seats is free ({len(work.running)} sequences "
                f"running, {len(work.waiting)} waiting{tokenizing}), {work.prefill:.0f} "
                f"prompt tokens ahead ({prefill:.1f} steps), at {step_s * 1000:.1f} ms a step "
                f"measured; {elsewhere:.2f}s of other models' work, each counted up to this "
                "LLM's)"
            )
        else:
            # The batch shrinks as its sequences finish: the first frees a seat (one still
            # waiting for its first step finishes no sooner than its whole generation).
            saturated = min(work.running + work.waiting, default=0.0) * step_s
            excess = max(saturated, max(latency, slowdown) - bound)
            longest = max(work.longest, max_tokens)
            why = (
                f"with this request ({size} sequences) {batch}: its own {max_tokens:.0f} "
                f"tokens would take an estimated {latency:.2f}s longer than alone, "
                f"{wait:.2f}s of it before its first step, and the longest generation "
                f"({longest:.0f} tokens) {slowdown:.2f}s"
            )
        retry_after = max(1.0, math.ceil(excess))
        raise CapacityError(
            f"{self.name} is overloaded: {why}, more than its max_queue_time_ms "
            f"({bound * 1000:g}); retry after {retry_after:g}s or send fewer concurrent "
            "requests",
            retry_after=retry_after,
            saturated_s=saturated,
        )
