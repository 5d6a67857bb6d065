"""Rate limits per API key: token buckets over requests per minute, tokens per minute and
tokens per day, and a bound on concurrent requests, decided at the ingress before a route.

A request of a key with limits is admitted only when every bucket holds what it costs: one
request, and as tokens its prompt (estimated from the body's length, about 4 bytes a token)
plus the `max_tokens` it asks for. A request that could never fit (its tokens over a
bucket's whole capacity) is refused as such; one that must wait is told how long. Once the
answer is complete the tokens are settled: the `usage` it reports replaces the estimate
(a stream's completion tokens are charged as its events pass, one a content event, as soon
as they go past what was reserved, unless it ends with a `usage` object). A refusal is 429
in OpenAI's error shape (`rate_limit_exceeded`) with `Retry-After`; every answer to a
limited key carries OpenAI's `x-ratelimit-{limit,remaining,reset}-{requests,tokens}`
headers, counted over the whole fleet.

The buckets are the fleet's: each is computed from what the key consumed on this replica
and on the others (hub.rate_limits.ledger), the others' as of the last sync through SQL
(hub.rate_limits.sync, every `auth.rate_limit_sync_interval`). No SQL runs on a
request's path, so N replicas together admit at most the limit plus what they admit before
the others hear of it: about one sync interval's worth. With the database down, each
replica decides on what it knows (its own consumption and the last the others reported).
`max_concurrent` is split instead: each replica allows its share (the limit divided by the
live replicas, rounded up).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from starlette.types import Message, Send

from hub.errors import HubError
from hub.rate_limits.ledger import DAY, MINUTE, REQUESTS, TOKENS, KeySpend, Ledger, Series
from registry.keys import KeyLimits

# Bytes of a request body per prompt token, for the estimate made before tokenizing.
BYTES_PER_TOKEN = 4
# Fields that bound a request's generated tokens, by API.
MAX_TOKEN_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
# The most of a JSON answer kept to read its `usage` (answers are small; embeddings aside).
USAGE_SCAN_BYTES = 1 << 20


class RateLimited(HubError):
    """Over a key's limit: 429, with when to retry."""

    status_code = 429
    error_type = "rate_limit_exceeded"


@dataclass
class Bucket:
    """One of a key's limits at one moment: `capacity` of `kind` a `period`, of which the
    fleet's consumption leaves `capacity - debt`."""

    kind: str
    count: int
    capacity: float
    period: float
    debt: float

    @property
    def level(self) -> float:
        return self.capacity - self.debt

    def wait(self, amount: float) -> float:
        """Seconds until `amount` is available."""
        return max(0.0, (amount - self.level) * self.period / self.capacity)

    def reset(self) -> float:
        """Seconds until the bucket is full again."""
        return self.wait(self.capacity)


@dataclass
class Admission:
    """One admitted request: what it reserved and has been charged so far (settled by
    `RateLimiter.settle`), and the headers its answer carries."""

    name: str
    spend: KeySpend
    clock: Callable[[], float]
    reserved: int
    prompt: int
    headers: dict[str, str]
    charged: int = 0
    streamed: int = 0
    usage: int | None = None
    stream: bool = False
    body: bytearray = field(default_factory=bytearray)

    def charge_to(self, tokens: int) -> None:
        """Charge the key so that this request has cost `tokens` in all."""
        if tokens != self.charged:
            self.spend.spend(self.clock(), 0, tokens - self.charged)
            self.charged = tokens


class RateLimiter:
    """The fleet's buckets of every limited key, and this replica's requests in progress;
    touched on the event loop only. `clock` is wall-clock time: slots are shared between
    replicas (their clocks are assumed in step, as NTP keeps them)."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.ledger = Ledger()
        self._in_flight: dict[str, int] = {}

    def admit(self, name: str, limits: KeyLimits, share: int, body: bytes | None) -> Admission:
        """Admit one request of key `name` or raise RateLimited; `share` is how many
        replicas split `max_concurrent`, `body` the request's bytes (None: not read)."""
        spend = self.ledger.key(name)
        now = self.clock()
        prompt, completion = estimate(body)
        tokens = prompt + completion
        buckets = _buckets(spend, limits, now)
        for bucket in buckets:
            amount = 1 if bucket.count == REQUESTS else tokens
            if amount <= bucket.level:
                continue
            headers = _headers(buckets)
            if amount > bucket.capacity:
                raise RateLimited(
                    f"this request needs about {amount:.0f} {bucket.kind}, more than this "
                    f"key's limit allows at once ({bucket.capacity:.0f} per "
                    f"{_period(bucket.period)}): lower max_tokens or split the input",
                    code="rate_limit_exceeded",
                    headers={**headers, "Retry-After": str(math.ceil(bucket.period))},
                )
            retry = max(1, math.ceil(bucket.wait(amount)))
            raise RateLimited(
                f"rate limit of API key {name!r} reached: {bucket.capacity:.0f} "
                f"{bucket.kind} per {_period(bucket.period)}; retry after {retry}s",
                code="rate_limit_exceeded",
                headers={**headers, "Retry-After": str(retry)},
            )
        in_flight = self._in_flight.get(name, 0)
        concurrent = limits.max_concurrent
        if concurrent is not None and in_flight >= math.ceil(concurrent / max(1, share)):
            raise RateLimited(
                f"API key {name!r} has {in_flight} requests in progress on this replica, "
                f"its share of max_concurrent {concurrent}; retry when one finishes",
                code="rate_limit_exceeded",
                headers={**_headers(buckets), "Retry-After": "1"},
            )
        spend.spend(now, 1, tokens)
        for bucket in buckets:
            bucket.debt += 1 if bucket.count == REQUESTS else tokens
        self._in_flight[name] = in_flight + 1
        return Admission(name, spend, self.clock, reserved=tokens, prompt=prompt,
                         headers=_headers(buckets), charged=tokens)  # fmt: skip

    def settle(self, admission: Admission) -> None:
        """The request ended: charge the tokens it used instead of those it reserved."""
        left = self._in_flight.get(admission.name, 1) - 1
        if left > 0:
            self._in_flight[admission.name] = left
        else:
            self._in_flight.pop(admission.name, None)
        used = admission.usage
        if used is None:
            used = admission.prompt + admission.streamed
        admission.charge_to(used)

    def status(self, name: str, limits: KeyLimits) -> dict[str, str]:
        """OpenAI's x-ratelimit-* headers for key `name` now, over the fleet."""
        return _headers(_buckets(self.ledger.key(name), limits, self.clock()))

    def prune(self) -> None:
        """Forget consumption older than its period, and keys with none and none in flight."""
        self.ledger.prune(self.clock(), busy=set(self._in_flight))


def _buckets(spend: KeySpend, limits: KeyLimits, now: float) -> list[Bucket]:
    out = []
    specs: list[tuple[str, int, int | None, Series]] = [
        ("requests", REQUESTS, limits.requests_per_minute, spend.minute),
        ("tokens", TOKENS, limits.tokens_per_minute, spend.minute),
        ("tokens", TOKENS, limits.tokens_per_day, spend.day),
    ]
    for kind, count, limit, series in specs:
        if limit is not None:
            debt = series.debt(count, float(limit), now)
            out.append(Bucket(kind, count, float(limit), series.period, debt))
    return out


def _headers(buckets: list[Bucket]) -> dict[str, str]:
    """OpenAI's x-ratelimit-* headers of the per-minute buckets."""
    out: dict[str, str] = {}
    for bucket in buckets:
        if bucket.period != MINUTE:
            continue
        out[f"x-ratelimit-limit-{bucket.kind}"] = str(round(bucket.capacity))
        out[f"x-ratelimit-remaining-{bucket.kind}"] = str(max(0, math.floor(bucket.level)))
        out[f"x-ratelimit-reset-{bucket.kind}"] = _duration(bucket.reset())
    return out


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


def metered(send: Send, admission: Admission) -> Send:
    """`send` that adds the admission's headers to the answer and counts what it used: the
    `usage` of a JSON answer, or a stream's content events (and its final `usage`)."""

    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start":
            raw = list(message.get("headers", []))
            for name, value in raw:
                if name == b"content-type":
                    admission.stream = value.startswith(b"text/event-stream")
            raw += [(k.encode(), v.encode()) for k, v in admission.headers.items()]
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
            # Past what it reserved, a stream is charged as it goes (the fleet sees it).
            if admission.prompt + admission.streamed > admission.charged:
                admission.charge_to(admission.prompt + admission.streamed)


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
    return "minute" if seconds == MINUTE else "day" if seconds == DAY else f"{seconds:g}s"


def _duration(seconds: float) -> str:
    """OpenAI's reset format: `20ms`, `1s`, `6m0s`."""
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    minutes, rest = divmod(math.ceil(seconds), 60)
    return f"{minutes}m{rest}s" if minutes else f"{rest}s"
