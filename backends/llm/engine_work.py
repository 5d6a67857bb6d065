"""The work an LLM engine has outstanding, in seconds, as its admission and its device see it.

An encoder's queue holds inputs of a known cost; an engine holds sequences, each with prompt
tokens still to prefill and up to `max_tokens` still to generate, run together in steps
whose cost depends on how many tokens they carry. So the engine's cost is measured per step
(`observe_step`: the seconds a step took and the tokens it ran, each an exponentially
weighted average) and its outstanding work is priced as

    outstanding tokens / tokens per step x seconds per step

where the outstanding tokens are what every unfinished sequence has left: its prompt tokens
not yet computed plus the tokens it may still generate (its `max_tokens` is the bound a
request sets: a sequence that stops early frees its share sooner). The engine thread
publishes the count at its step boundaries (`publish`); requests added since are counted by
the `incoming` callable the engine gives (what they will cost, read from its incoming queue).

Contract: `admit(size, tokens)` raises `CapacityError` when the work ahead of a new
request on its device (this engine's outstanding work plus what the other models on the same
device have outstanding, from `DeviceWork`) is over `max_queue_time_s`, naming the estimate,
its parts and the bound, with a `retry_after` of about the time the excess needs and that
time as `saturated_s` (the HTTP edge refuses the model's next requests at once until then).
`reserve()` makes the same check before a request is tokenized and counts it until
`unreserve()` (at the average admitted request's tokens), so that a burst is refused before
its prompts are tokenized rather than after.
Nothing is refused until a step was measured, and an engine with nothing outstanding admits
a request whatever the others have (no model starves behind another's steady load), as the
encoders' admission does (backends/admission.py). `outstanding_s()` reads published numbers
only: any thread may call it (the other models' admission checks do, through `DeviceWork`).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from backends.admission import EWMA_ALPHA, DeviceWork
from backends.errors import CapacityError

if TYPE_CHECKING:
    from backends.llm.sequence import Sequence


def tokens_left(seq: Sequence) -> int:
    """What `seq` still costs in tokens: those not computed yet (a prompt, or what a
    preemption dropped) plus those it may still generate."""
    return (seq.num_tokens - seq.num_computed_tokens) + max(
        0, seq.max_tokens - seq.num_output_tokens
    )


class EngineWork:
    """One engine's measured step cost and published outstanding tokens. `max_queue_time_s`
    None: never refuses, only measures and publishes. `incoming`: the tokens of the requests
    added since the last publication (any thread may call it; it must not block)."""

    def __init__(
        self,
        max_queue_time_s: float | None,
        incoming: Callable[[], int] = lambda: 0,
        *,
        name: str = "this LLM",
        alpha: float = EWMA_ALPHA,
    ) -> None:
        if max_queue_time_s is not None and max_queue_time_s < 0:
            raise ValueError("max_queue_time_s must be >= 0")
        self.max_queue_time_s = max_queue_time_s
        self._incoming = incoming
        self.name = name
        self._alpha = alpha
        self._step_s: float | None = None
        self._tokens_per_step: float | None = None
        # Published by the engine thread; read by any thread (a float and an int assignment
        # each, so a reader never sees half an update of one of them).
        self.tokens = 0
        self.sequences = 0
        # Requests checked before tokenizing and not yet added (`reserve`), counted at the
        # average admitted request's tokens; touched on the event loop only.
        self.reserved = 0
        self._request_tokens: float | None = None
        self._device: DeviceWork | None = None
        self._token: int | None = None

    # ---- measurement (engine thread) ---------------------------------------------------
    def observe_step(self, tokens: int, seconds: float) -> None:
        """A step ran `tokens` tokens (prefill chunks and decodes) in `seconds`."""
        if tokens < 1 or not math.isfinite(seconds) or seconds < 0:
            return
        if self._step_s is None or self._tokens_per_step is None:
            self._step_s, self._tokens_per_step = seconds, float(tokens)
            return
        self._step_s += self._alpha * (seconds - self._step_s)
        self._tokens_per_step += self._alpha * (tokens - self._tokens_per_step)

    def publish(self, sequences: Iterable[Sequence]) -> None:
        """The unfinished sequences now (the scheduler's waiting and running ones)."""
        tokens = count = 0
        for seq in sequences:
            tokens += tokens_left(seq)
            count += 1
        self.tokens, self.sequences = tokens, count

    @property
    def seconds_per_token(self) -> float | None:
        """The measured cost of one outstanding token (seconds per step over tokens per
        step), or None before a step was measured."""
        if self._step_s is None or not self._tokens_per_step:
            return None
        return self._step_s / self._tokens_per_step

    # ---- the estimate (any thread) -----------------------------------------------------
    def outstanding_tokens(self) -> int:
        """The tokens of the work this engine holds: published, incoming and reserved."""
        reserved = round(self.reserved * (self._request_tokens or 0.0))
        return self.tokens + self._incoming() + reserved

    def outstanding_s(self) -> float:
        """Seconds this engine needs for the work it holds (0 until a step was measured)."""
        per_token = self.seconds_per_token
        return 0.0 if per_token is None else self.outstanding_tokens() * per_token

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

    def reserve(self) -> None:
        """Check a request before it is tokenized (CapacityError as `admit`), and count it
        at the average request's tokens until `unreserve`: tokenizing takes the request off
        the event loop, and a burst's requests would otherwise all pass this check before
        the first of them is added. Call on the event loop."""
        self._check(1)
        self.reserved += 1

    def unreserve(self) -> None:
        """A reserved request was tokenized (`admit` checks it again as it is added) or
        failed."""
        self.reserved = max(0, self.reserved - 1)

    def admit(self, size: int, tokens: int) -> None:
        """Admit a request of `size` sequences and `tokens` tokens (prompts and max_tokens),
        or raise CapacityError (naming the estimate) when the work ahead of it on its device
        is over the bound."""
        self._check(size)
        if self._request_tokens is None:
            self._request_tokens = float(tokens)
        else:
            self._request_tokens += self._alpha * (tokens - self._request_tokens)

    def _check(self, size: int) -> None:
        bound = self.max_queue_time_s
        per_token = self.seconds_per_token
        if bound is None or per_token is None:
            return
        tokens = self.outstanding_tokens()
        if tokens == 0:
            return
        own = tokens * per_token
        elsewhere = 0.0
        if self._device is not None:
            elsewhere = self._device.outstanding_s(excluding=self._token)
        wait = own + elsewhere
        if wait <= bound:
            return
        retry_after = max(1.0, math.ceil(wait - bound))
        step_ms = (self._step_s or 0.0) * 1000
        if self.reserved:
            tokens_ahead = f"{tokens} tokens ({self.reserved} requests being tokenized among them)"
        else:
            tokens_ahead = f"{tokens} tokens"
        raise CapacityError(
            f"{self.name} is overloaded: an estimated {wait:.2f}s of work is ahead of this "
            f"request ({size} sequences) on its device ({own:.2f}s of this LLM's: {tokens_ahead} "
            f"left to prefill or generate at the measured {self._tokens_per_step:.1f} "
            f"tokens per {step_ms:.1f} ms step; {elsewhere:.2f}s of other models' work), more "
            f"than its max_queue_time_ms ({bound * 1000:g}); retry after {retry_after:g}s or "
            "send fewer concurrent requests",
            retry_after=retry_after,
            # Arrivals only add to the work: it stays over the bound at least this long,
            # unless this engine's own work ends first (then the next request is admitted).
            saturated_s=min(wait - bound, own),
        )
