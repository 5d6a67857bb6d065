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

A key's limits hold over everything it does, and `limits.models` adds limits of the key on
one model (hub.rate_limits.scopes): a request counts in its key's scope and in the scope of
each model it counts against, each with buckets of its own, and is admitted only when it
fits them all. A refusal names the limit it hit (`tokens_per_minute for model tiny-llama`);
the headers report, of each kind, the bucket with the least remaining, as OpenAI's
per-model limits are reported.

The buckets are the fleet's: each is computed from what the scope consumed on this replica
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
from hub.rate_limits.scopes import LimitScope, scopes_of
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
    """One limit of a scope at one moment: `capacity` of `kind` a `period`, of which the
    fleet's consumption leaves `capacity - debt`; `limit` the field that set it and `scope`
    whose it is."""

    kind: str
    count: int
    capacity: float
    period: float
    debt: float
    limit: str
    scope: LimitScope

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
    """One admitted request: the scopes it counts in (`ledgers`, each spending into its
    `spends`), what it reserved and has been charged so far (settled by
    `RateLimiter.settle`), and the headers its answer carries."""

    ledgers: tuple[str, ...]
    spends: tuple[KeySpend, ...]
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
        """Charge every scope so that this request has cost `tokens` in all."""
        if tokens != self.charged:
            now = self.clock()
            for spend in self.spends:
                spend.spend(now, 0, tokens - self.charged)
            self.charged = tokens


class RateLimiter:
    """The fleet's buckets of every limited key (and key on a model), and this replica's
    requests in progress; touched on the event loop only. `clock` is wall-clock time: slots
    are shared between replicas (their clocks are assumed in step, as NTP keeps them)."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.ledger = Ledger()
        self._in_flight: dict[str, int] = {}

    def admit(
        self,
        name: str,
        limits: KeyLimits,
        share: int,
        body: bytes | None,
        models: tuple[str, ...] = (),
    ) -> Admission:
        """Admit one request of key `name` or raise RateLimited; `share` is how many
        replicas split `max_concurrent`, `body` the request's bytes (None: not read),
        `models` the registered names it counts against (`scopes.counted_models`)."""
        scopes = scopes_of(name, limits, models)
        spends = tuple(self.ledger.key(scope.ledger) for scope in scopes)
        now = self.clock()
        prompt, completion = estimate(body)
        tokens = prompt + completion
        buckets = [
            bucket
            for scope, spend in zip(scopes, spends, strict=True)
            for bucket in _buckets(spend, scope, now)
        ]
        for bucket in buckets:
            amount = 1 if bucket.count == REQUESTS else tokens
            if amount <= bucket.level:
                continue
            headers = _headers(buckets)
            limit = bucket.scope.describe(bucket.limit)
            per = f"{bucket.capacity:.0f} {bucket.kind} per {_period(bucket.period)}"
            if amount > bucket.capacity:
                raise RateLimited(
                    f"this request needs about {amount:.0f} {bucket.kind}, more than API key "
                    f"{name!r} may use at once under {limit} ({per}): lower max_tokens or "
                    "split the input",
                    code="rate_limit_exceeded",
                    headers={**headers, "Retry-After": str(math.ceil(bucket.period))},
                )
            retry = max(1, math.ceil(bucket.wait(amount)))
            raise RateLimited(
                f"rate limit of API key {name!r} reached: {limit} ({per}); retry after {retry}s",
                code="rate_limit_exceeded",
                headers={**headers, "Retry-After": str(retry)},
            )
        for scope in scopes:
            in_flight = self._in_flight.get(scope.ledger, 0)
            concurrent = scope.limits.max_concurrent
            if concurrent is not None and in_flight >= math.ceil(concurrent / max(1, share)):
                where = f" for model {scope.model}" if scope.model is not None else ""
                raise RateLimited(
                    f"API key {name!r} has {in_flight} requests{where} in progress on this "
                    f"replica, its share of max_concurrent {concurrent}{where}; retry when one "
                    "finishes",
                    code="rate_limit_exceeded",
                    headers={**_headers(buckets), "Retry-After": "1"},
                )
        for spend in spends:
            spend.spend(now, 1, tokens)
        for bucket in buckets:
            bucket.debt += 1 if bucket.count == REQUESTS else tokens
        ledgers = tuple(scope.ledger for scope in scopes)
        for ledger in ledgers:
            self._in_flight[ledger] = self._in_flight.get(ledger, 0) + 1
        return Admission(ledgers, spends, self.clock, reserved=tokens, prompt=prompt,
                         headers=_headers(buckets), charged=tokens)  # fmt: skip

    def settle(self, admission: Admission) -> None:
        """The request ended: charge the tokens it used instead of those it reserved."""
        for ledger in admission.ledgers:
            left = self._in_flight.get(ledger, 1) - 1
            if left > 0:
                self._in_flight[ledger] = left
            else:
                self._in_flight.pop(ledger, None)
        used = admission.usage
        if used is None:
            used = admission.prompt + admission.streamed
        admission.charge_to(used)

    def status(self, name: str, limits: KeyLimits, models: tuple[str, ...] = ()) -> dict[str, str]:
        """OpenAI's x-ratelimit-* headers for key `name` on `models` now, over the fleet."""
        now = self.clock()
        buckets = [
            bucket
            for scope in scopes_of(name, limits, models)
            for bucket in _buckets(self.ledger.key(scope.ledger), scope, now)
        ]
        return _headers(buckets)

    def prune(self) -> None:
        """Forget consumption older than its period, and scopes with none and none in flight."""
        self.ledger.prune(self.clock(), busy=set(self._in_flight))


def _buckets(spend: KeySpend, scope: LimitScope, now: float) -> list[Bucket]:
    out = []
    limits = scope.limits
    specs: list[tuple[str, int, str, int | None, Series]] = [
        ("requests", REQUESTS, "requests_per_minute", limits.requests_per_minute, spend.minute),
        ("tokens", TOKENS, "tokens_per_minute", limits.tokens_per_minute, spend.minute),
        ("tokens", TOKENS, "tokens_per_day", limits.tokens_per_day, spend.day),
    ]
    for kind, count, limit, capacity, series in specs:
        if capacity is not None:
            debt = series.debt(count, float(capacity), now)
            out.append(Bucket(kind, count, float(capacity), series.period, debt, limit, scope))
    return out


def _headers(buckets: list[Bucket]) -> dict[str, str]:
    """OpenAI's x-ratelimit-* headers of the per-minute buckets: of each kind, the one with
    the least remaining (a key's own or its model's)."""
    tightest: dict[str, Bucket] = {}
    for bucket in buckets:
        if bucket.period != MINUTE:
            continue
        held = tightest.get(bucket.kind)
        if held is None or bucket.level < held.level:
            tightest[bucket.kind] = bucket
    out: dict[str, str] = {}
    for kind, bucket in tightest.items():
        out[f"x-ratelimit-limit-{kind}"] = str(round(bucket.capacity))
        out[f"x-ratelimit-remaining-{kind}"] = str(max(0, math.floor(bucket.level)))
        out[f"x-ratelimit-reset-{kind}"] = _duration(bucket.reset())
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

    if not admission.spends:  # in no limited scope: nothing to count or report
        return send

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
