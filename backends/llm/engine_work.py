"""The work an LLM engine has outstanding, in seconds, as its admission and its device see it.

An encoder's queue holds inputs of a known cost; an engine holds sequences, each with prompt
tokens still to prefill and up to `max_tokens` still to generate, run together in steps.
Decodes of different sequences share a step (up to `max_num_seqs` of them), prompt tokens
fill a step's token budget (`max_num_batched_tokens`), and one sequence's tokens are
generated one step after another. So the work is counted in steps,

    steps = max(longest generation left, tokens to generate / max_num_seqs)
            + prompt tokens to prefill / max_num_batched_tokens

and priced at the measured seconds per step (`observe_step`, an exponentially weighted
average: it grows as the batch grows, or as other work contends for the device), or at what
the step in flight has taken so far when that is already well over the average (a burst
contends for the device at once, long before the steps' end teaches the average). What a
sequence may still generate is its `max_tokens` less what it generated: the bound its request
set (a sequence that stops early frees its share sooner). The engine thread publishes its
sequences' work at its step boundaries (`publish`); requests added since are read through
the `incoming` callable the engine gives (their sequences, from its incoming queue).

Contract: `admit(size, prompt_tokens, max_tokens)` raises `CapacityError` when the work
ahead of a new request on its device (this engine's outstanding work plus what the other
models on the same device have outstanding, from `DeviceWork`) is over `max_queue_time_s`,
naming the estimate, its parts and the bound, with a `retry_after` of about the time the
excess needs and that time as `saturated_s` (the HTTP edge refuses the model's next requests
at once until then). `reserve()` makes the same check before a request is tokenized and
counts it until `unreserve()` (as the average admitted request), so that a burst is refused
before its prompts are tokenized rather than after. Nothing is refused until a step was
measured, and an engine with nothing outstanding admits a request whatever the others have
(no model starves behind another's steady load), as the encoders' admission does
(backends/admission.py). `outstanding_s()` reads published numbers only: any thread may call
it (the other models' admission checks do, through `DeviceWork`).
"""

from __future__ import annotations

import math
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from backends.admission import EWMA_ALPHA, DeviceWork
from backends.errors import CapacityError

# A step in flight that has taken more than this many times the average reprices the work at
# once (the device is contended now: the average learns it only as steps end).
SLOW_STEP = 1.5

if TYPE_CHECKING:
    from backends.llm.sequence import Sequence


@dataclass(frozen=True)
class Work:
    """Sequences' work: prompt tokens to prefill, tokens they may still generate (in all,
    and the most one of them may), and how many sequences."""

    prefill: float = 0.0
    generate: float = 0.0
    longest: float = 0.0
    sequences: float = 0.0

    def __add__(self, other: Work) -> Work:
        return Work(
            self.prefill + other.prefill,
            self.generate + other.generate,
            max(self.longest, other.longest),
            self.sequences + other.sequences,
        )

    def __bool__(self) -> bool:
        return self.sequences > 0

    @classmethod
    def of(cls, sequences: Iterable[Sequence]) -> Work:
        prefill = generate = longest = count = 0
        for seq in sequences:
            # Once a token was sampled, the last one is computed by the next decode: only
            # the rest (what a preemption dropped) is prefilled.
            pending = seq.num_tokens - seq.num_computed_tokens
            prefill += pending if seq.num_output_tokens == 0 else max(0, pending - 1)
            left = max(0, seq.max_tokens - seq.num_output_tokens)
            generate += left
            longest = max(longest, left)
            count += 1
        return cls(prefill, generate, longest, count)


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
    def observe_step(self, tokens: int, seconds: float) -> None:
        """A step ran `tokens` tokens (prefill chunks and decodes) in `seconds`."""
        if tokens < 1 or not math.isfinite(seconds) or seconds < 0:
            return
        if self._step_s is None:
            self._step_s = seconds
        else:
            self._step_s += self._alpha * (seconds - self._step_s)

    def publish(self, sequences: Iterable[Sequence]) -> None:
        """The unfinished sequences now (the scheduler's waiting and running ones)."""
        self.published = Work.of(sequences)

    @property
    def step_s(self) -> float | None:
        """The measured seconds per step, or None before a step was measured."""
        return self._step_s

    def step_cost(self) -> float | None:
        """What a step costs now: the average, or what the step in flight has taken so far
        where that is over SLOW_STEP times the average; None before a step was measured."""
        average, started = self._step_s, self.step_started
        if average is None or started is None:
            return average
        elapsed = self.clock() - started
        return elapsed if elapsed > SLOW_STEP * average else average

    # ---- the estimate (any thread) -----------------------------------------------------
    def outstanding(self) -> Work:
        """The work this engine holds: published, incoming and reserved."""
        work = self.published + Work.of(self._incoming())
        if self.reserved and self._average is not None:
            average = self._average
            work += Work(
                average.prefill * self.reserved,
                average.generate * self.reserved,
                average.longest,
                average.sequences * self.reserved,
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
        """Check a request before it is tokenized (CapacityError as `admit`), and count it
        as the average admitted request until `unreserve`: tokenizing takes the request off
        the event loop, and a burst's requests would otherwise all pass this check before
        the first of them is added."""
        self._check(1)
        self.reserved += 1

    def unreserve(self) -> None:
        """A reserved request was tokenized (`admit` checks it again as it is added) or
        failed."""
        self.reserved = max(0, self.reserved - 1)

    def admit(self, size: int, prompt_tokens: int, max_tokens: int) -> None:
        """Admit a request of `size` sequences of `prompt_tokens` and up to `max_tokens`
        each, or raise CapacityError (naming the estimate) when the work ahead of it on its
        device is over the bound."""
        self._check(size)
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

    def _check(self, size: int) -> None:
        bound = self.max_queue_time_s
        step_s = self.step_cost()
        if bound is None or step_s is None:
            return
        work = self.outstanding()
        if not work:
            return
        own = self.steps(work) * step_s
        elsewhere = 0.0
        if self._device is not None:
            elsewhere = self._device.outstanding_s(excluding=self._token)
        wait = own + elsewhere
        if wait <= bound:
            return
        retry_after = max(1.0, math.ceil(wait - bound))
        tokenizing = f", {self.reserved} being tokenized" if self.reserved else ""
        raise CapacityError(
            f"{self.name} is overloaded: an estimated {wait:.2f}s of work is ahead of this "
            f"request ({size} sequences) on its device ({own:.2f}s of this LLM's: "
            f"{work.sequences:.0f} sequences{tokenizing}, {work.generate:.0f} tokens to "
            f"generate, at most {work.longest:.0f} in one, and {work.prefill:.0f} prompt "
            f"tokens, {self.steps(work):.1f} steps at {step_s * 1000:.1f} ms measured; "
            f"{elsewhere:.2f}s of other models' work), more than its max_queue_time_ms "
            f"({bound * 1000:g}); retry after {retry_after:g}s or send fewer concurrent "
            "requests",
            retry_after=retry_after,
            # Arrivals only add to the work: it stays over the bound at least this long,
            # unless this engine's own work ends first (then the next request is admitted).
            saturated_s=min(wait - bound, own),
        )
