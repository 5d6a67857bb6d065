"""Rate limits per API key: token buckets over requests per minute, tokens per minute and
tokens per day, and a bound on concurrent requests, decided at the ingress before a route.

A request of a key with limits is admitted only when every bucket holds what it costs: one
request, and as tokens its prompt (estimated from the body's length, about 4 bytes a token)
plus the `max_tokens` it asks for. A request that could never fit (its tokens over a
bucket's whole capacity) is refused as such; one that must wait is told how long. Once the
answer is complete the tokens are settled: the `usage` it reports replaces the estimate
(a stream's completion tokens are charged as its events pass, one a content event, unless
it ends with a `usage` object). A refusal is 429 in OpenAI's error shape
(`rate_limit_exceeded`) with `Retry-After`; every answer to a limited key carries OpenAI's
`x-ratelimit-{limit,remaining,reset}-{requests,tokens}` headers.

Across replicas each one enforces its share of a limit (the limit divided by the live
replicas, rounded up), so N replicas together admit at most the limit plus rounding, with
no SQL on the request path.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from starlette.types import Message, Send

from hub.errors import HubError
from registry.keys import KeyLimits

# Bytes of a request body per prompt token, for the estimate made before tokenizing.
BYTES_PER_TOKEN = 4
# Fields that bound a request's generated tokens, by API.
MAX_TOKEN_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
# The most of a JSON answer kept to read its `usage` (answers are small; embeddings aside).
USAGE_SCAN_BYTES = 1 << 20
MINUTE, DAY = 60.0, 86400.0


class RateLimited(HubError):
    """Over a key's limit: 429, with when to retry."""

    status_code = 429
    error_type = "rate_limit_exceeded"


@dataclass
class Bucket:
    """`capacity` units refilled at `capacity / period` per second; its level may go below
    zero when a request used more than it reserved (the debt delays the next ones)."""

    capacity: float
    period: float
    level: float
    stamp: float

    def refill(self, now: float) -> None:
        rate = self.capacity / self.period
        self.level = min(self.capacity, self.level + (now - self.stamp) * rate)
        self.stamp = now

    def wait(self, amount: float) -> float:
        """Seconds until `amount` is available (after `refill`)."""
        return max(0.0, (amount - self.level) * self.period / self.capacity)

    def reset(self) -> float:
        """Seconds until the bucket is full again."""
        return self.wait(self.capacity)


@dataclass
class KeyState:
    """One key's buckets on this replica, for the limits (and share) they were made for."""

    limits: KeyLimits
    share: int
    requests: Bucket | None
    tokens_minute: Bucket | None
    tokens_day: Bucket | None
    in_flight: int = 0


@dataclass
class Admission:
    """One admitted request: what it reserved, settled by `RateLimiter.settle`."""

    state: KeyState
    reserved: int
    prompt: int
    streamed: int = 0
    usage: int | None = None
    stream: bool = False
    body: bytearray = field(default_factory=bytearray)


class RateLimiter:
    """The buckets of every limited key on this replica; touched on the event loop only."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._keys: dict[str, KeyState] = {}

    def admit(self, name: str, limits: KeyLimits, share: int, body: bytes | None) -> Admission:
        """Admit one request of key `name` or raise RateLimited; `share` is how many
        replicas split the limits, `body` the request's bytes (None: not read)."""
        state = self._state(name, limits, max(1, share))
        now = self.clock()
        prompt, completion = estimate(body)
        tokens = prompt + completion
        buckets = [("requests", state.requests, 1.0), ("tokens", state.tokens_minute, tokens),
                   ("tokens", state.tokens_day, tokens)]  # fmt: skip
        for _, bucket, _ in buckets:
            if bucket is not None:
                bucket.refill(now)
        headers = self.headers(state)
        for kind, bucket, amount in buckets:
            if bucket is None or amount <= bucket.level:
                continue
            if amount > bucket.capacity:
                raise RateLimited(
                    f"this request needs about {amount:.0f} {kind}, more than this key's "
                    f"limit allows at once ({bucket.capacity:.0f} per "
                    f"{_period(bucket.period)} on this replica): lower max_tokens or "
                    "split the input",
                    code="rate_limit_exceeded",
                    headers={**headers, "Retry-After": str(math.ceil(bucket.period))},
                )
            retry = max(1, math.ceil(bucket.wait(amount)))
            raise RateLimited(
                f"rate limit of API key {name!r} reached: {bucket.capacity:.0f} {kind} per "
                f"{_period(bucket.period)} on this replica; retry after {retry}s",
                code="rate_limit_exceeded",
                headers={**headers, "Retry-After": str(retry)},
            )
        concurrent = limits.max_concurrent
        if concurrent is not None and state.in_flight >= math.ceil(concurrent / state.share):
            raise RateLimited(
                f"API key {name!r} has {state.in_flight} requests in progress on this "
                f"replica, its limit (max_concurrent {concurrent}); retry when one finishes",
                code="rate_limit_exceeded",
                headers={**headers, "Retry-After": "1"},
            )
        for _, bucket, amount in buckets:
            if bucket is not None:
                bucket.level -= amount
        state.in_flight += 1
        return Admission(state, reserved=tokens, prompt=prompt)

    def settle(self, admission: Admission) -> None:
        """The request ended: charge the tokens it used instead of those it reserved."""
        state = admission.state
        state.in_flight -= 1
        used = admission.usage
        if used is None:
            used = admission.prompt + admission.streamed
        refund = admission.reserved - used
        for bucket in (state.tokens_minute, state.tokens_day):
            if bucket is not None:
                bucket.level = min(bucket.capacity, bucket.level + refund)

    def headers(self, state: KeyState) -> dict[str, str]:
        """OpenAI's x-ratelimit-* headers for the key's buckets now (after a refill)."""
        out: dict[str, str] = {}
        for kind, bucket in (("requests", state.requests), ("tokens", state.tokens_minute)):
            if bucket is None:
                continue
            out[f"x-ratelimit-limit-{kind}"] = str(round(bucket.capacity))
            out[f"x-ratelimit-remaining-{kind}"] = str(max(0, math.floor(bucket.level)))
            out[f"x-ratelimit-reset-{kind}"] = _duration(bucket.reset())
        return out

    def _state(self, name: str, limits: KeyLimits, share: int) -> KeyState:
        state = self._keys.get(name)
        if state is not None and state.limits == limits and state.share == share:
            return state
        now = self.clock()

        def bucket(limit: int | None, period: float) -> Bucket | None:
            if limit is None:
                return None
            capacity = float(math.ceil(limit / share))
            return Bucket(capacity, period, capacity, now)

        fresh = KeyState(limits, share, bucket(limits.requests_per_minute, MINUTE),
                         bucket(limits.tokens_per_minute, MINUTE),
                         bucket(limits.tokens_per_day, DAY))  # fmt: skip
        if state is not None:  # changed limits: keep what was used and what is in flight
            fresh.in_flight = state.in_flight
            for old, new in ((state.requests, fresh.requests),
                             (state.tokens_minute, fresh.tokens_minute),
                             (state.tokens_day, fresh.tokens_day)):  # fmt: skip
                if old is not None and new is not None:
                    new.level = min(new.capacity, old.level)
        self._keys[name] = fresh
        return fresh


def estimate(body: bytes | None) -> tuple[int, int]:
    """(prompt tokens estimated from the body's length, the max tokens it asks for)."""
    if not body:
        return 0, 0
    prompt = math.ceil(len(body) / BYTES_PER_TOKEN)
    try:
        fields = json.loads(body)
    except (ValueError, RecursionError):
        return prompt, 0
    completion = 0
    if isinstance(fields, dict):
        for name in MAX_TOKEN_FIELDS:
            value = fields.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                completion = value
                n = fields.get("n")
                if isinstance(n, int) and not isinstance(n, bool) and n > 1:
                    completion *= n
                break
    return prompt, completion


def metered(send: Send, admission: Admission, headers: dict[str, str]) -> Send:
    """`send` that adds `headers` to the answer and counts what the answer used: the
    `usage` of a JSON answer, or a stream's content events (and its final `usage`)."""

    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start":
            raw = list(message.get("headers", []))
            for name, value in raw:
                if name == b"content-type":
                    admission.stream = value.startswith(b"text/event-stream")
            raw += [(k.encode(), v.encode()) for k, v in headers.items()]
            message = {**message, "headers": raw}
        elif message["type"] == "http.response.body":
            chunk = message.get("body", b"")
            if admission.stream:
                _count_events(admission, chunk)
            elif len(admission.body) + len(chunk) <= USAGE_SCAN_BYTES:
                admission.body += chunk
                if not message.get("more_body", False):
                    admission.usage = _usage(bytes(admission.body))
        await send(message)

    return sending


def _count_events(admission: Admission, chunk: bytes) -> None:
    for line in chunk.split(b"\n"):
        if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
            continue
        usage = _usage(line[5:]) if b'"usage"' in line else None
        if usage is not None:
            admission.usage = usage
        elif b'"choices":[]' not in line.replace(b" ", b""):
            admission.streamed += 1


def _usage(raw: bytes) -> int | None:
    """The total tokens an answer's `usage` reports, if it has one."""
    try:
        answer = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    usage = answer.get("usage") if isinstance(answer, dict) else None
    if not isinstance(usage, dict):
        return None
    total = usage.get("total_tokens")
    if isinstance(total, int):
        return total
    parts = [usage.get(k) for k in ("prompt_tokens", "completion_tokens", "input_tokens",
                                    "output_tokens")]  # fmt: skip
    counted = [p for p in parts if isinstance(p, int)]
    return sum(counted) if counted else None


def _period(seconds: float) -> str:
    return "minute" if seconds == MINUTE else "day"


def _duration(seconds: float) -> str:
    """OpenAI's reset format: `20ms`, `1s`, `6m0s`."""
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    minutes, rest = divmod(math.ceil(seconds), 60)
    return f"{minutes}m{rest}s" if minutes else f"{rest}s"
