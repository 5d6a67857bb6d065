"""A request's scheduling level: its API key's priority class, lowered (never raised) by what
the request asks for.

A key has a class (`interactive`, `standard` or `batch`; see `backends.priority` for their
levels -1, 0 and 1). A request may ask, in `priority`, for a class by name or for an integer
level (vLLM's and Cohere's field: lower first), and in `service_tier` for OpenAI's `"flex"`
(the batch class) or `"priority"` (interactive). What it asks is honoured when it is no
better than its key's class; a request asking for more runs at its key's class: not an
error, as OpenAI serves a tier an organisation lacks at its default.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Request
from pydantic import Field

from backends.llm.sampling_params import MAX_COUNT
from backends.priority import PriorityClass
from hub.api.ingress import head_of

# The body field: a class name or an integer level; None: the key's class.
RequestedPriority = Annotated[int, Field(ge=-MAX_COUNT, le=MAX_COUNT)] | PriorityClass | None

# OpenAI's `service_tier` values that name a class; others ("auto", "default") ask nothing.
_SERVICE_TIERS = {"flex": PriorityClass.BATCH, "priority": PriorityClass.INTERACTIVE}


def key_priority(request: Request) -> PriorityClass:
    """The priority class of the API key that made `request`, as the ingress authenticated
    it (`Head.caller`); standard where no key was checked (auth off, a route the ingress
    does not read)."""
    head = head_of(request.scope)
    caller = head.caller if head is not None else None
    if caller is None:
        return PriorityClass.STANDARD
    return PriorityClass(caller.policy.priority)


def request_level(
    request: Request, priority: int | str | None = None, service_tier: str | None = None
) -> int:
    """The level `request` runs at: the lowest-ranked of what it asks, bounded by its key's
    class (`resolve_level`)."""
    return resolve_level(key_priority(request), priority, service_tier)


def resolve_level(
    key_class: PriorityClass, priority: int | str | None = None, service_tier: str | None = None
) -> int:
    """The key's class level, or what the request asks where that ranks lower (a larger
    level). Both fields given: the lower-ranked of the two."""
    level = key_class.level
    asked = [_level(priority)]
    tier = _SERVICE_TIERS.get(service_tier or "")
    if tier is not None:
        asked.append(tier.level)
    for wanted in asked:
        if wanted is not None:
            level = max(level, wanted)
    return level


def _level(priority: int | str | None) -> int | None:
    if priority is None or isinstance(priority, int):
        return priority
    return PriorityClass(priority).level
