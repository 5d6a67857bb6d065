"""`GET /admin/usage`: metered usage summed over every replica, read from SQL (hub.usage).

    GET /admin/usage?key=team-a&model=chat&since=2026-11-01T00:00:00Z&group_by=key,model,hour

`key` and `model` filter on the caller (the API key's name; "anonymous" with auth off) and
the model that answered; `since` (inclusive: from the start of its hour) and `until`
(exclusive) are ISO 8601 times, UTC when no offset is given; `group_by` is a comma list of
key, model, version and hour (default key,model,version; empty: one grand total). Each row
names the dimensions it was grouped by (the others null) and the sums.
"""

from __future__ import annotations

import datetime as dt
from typing import Annotated

from fastapi import APIRouter, Depends, Query
from pydantic import BaseModel, Field

from hub.api.deps import HubDep, require_admin
from hub.errors import BadRequest, Unavailable
from hub.sql_worker import failure_reason
from registry.usage import DIMENSIONS, UsageQuery, UsageTotal

router = APIRouter(prefix="/admin", tags=["admin"], dependencies=[Depends(require_admin)])


class UsagePublic(BaseModel):
    key: str | None = Field(description="the caller: the API key's name (null: not grouped)")
    model: str | None
    version: int | None
    hour: dt.datetime | None = Field(description="the start of the UTC hour, when grouped by hour")
    requests: int
    errors: int = Field(description="requests answered with an error after reaching a model")
    prompt_tokens: int = Field(description="tokens read: prompts, embedding inputs, rerank pairs")
    completion_tokens: int
    total_tokens: int
    embedded_inputs: int
    embedded_tokens: int
    rerank_documents: int

    @classmethod
    def of(cls, total: UsageTotal) -> UsagePublic:
        c = total.counts
        return cls(
            key=total.key,
            model=total.model,
            version=total.version,
            hour=total.hour,
            total_tokens=c.prompt_tokens + c.completion_tokens,
            **c.as_dict(),
        )


def _moment(value: str | None, param: str) -> dt.datetime | None:
    """`value` as an aware UTC time (no offset: UTC); None when absent."""
    if value is None or not value.strip():
        return None
    try:
        moment = dt.datetime.fromisoformat(value.strip())
        if moment.tzinfo is None:
            moment = moment.replace(tzinfo=dt.UTC)
        return moment.astimezone(dt.UTC)
    except (ValueError, OverflowError):
        raise BadRequest(
            f"{param} must be an ISO 8601 time such as 2026-11-01T00:00:00Z, not {value!r}",
            param=param,
        ) from None


def _dimensions(value: str) -> tuple[str, ...]:
    wanted = tuple(d.strip() for d in value.split(",") if d.strip())
    unknown = [d for d in wanted if d not in DIMENSIONS]
    if unknown:
        raise BadRequest(
            f"cannot group usage by {', '.join(map(repr, unknown))}: choose among "
            f"{', '.join(DIMENSIONS)}",
            param="group_by",
        )
    return wanted


@router.get("/usage", response_model=list[UsagePublic])
async def usage(
    hub: HubDep,
    key: Annotated[str | None, Query(description="only this caller (API key name)")] = None,
    model: Annotated[str | None, Query(description="only this model")] = None,
    since: Annotated[str | None, Query(description="ISO 8601 time, inclusive")] = None,
    until: Annotated[str | None, Query(description="ISO 8601 time, exclusive")] = None,
    group_by: Annotated[str, Query(description="comma list of key, model, version, hour")] = (
        "key,model,version"
    ),
) -> list[UsagePublic]:
    query = UsageQuery(
        key=key or None,
        model=model or None,
        since=_moment(since, "since"),
        until=_moment(until, "until"),
        group_by=_dimensions(group_by),
    )
    meter = hub.usage
    if meter is None:
        raise BadRequest("usage metering is off on this hub (usage.enabled: false)")
    try:
        totals = await meter.totals(query)
    except Exception as e:
        raise Unavailable(
            f"usage could not be read: {failure_reason(e, 'usage.sql_timeout')}",
            code="dependency_unavailable",
        ) from e
    return [UsagePublic.of(t) for t in totals]
