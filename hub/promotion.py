"""Promotion and rollback: the only way `staging` and `production` move.

`promote(name, version, to)` runs the candidate through the validation gate, stores the
result on the version, and only if it passed moves the alias (MLflow + audit event, with a
compare-and-set against the alias value seen before the gate ran, so concurrent promotions of
one model serialise and none silently overwrites another). Production requires having passed
staging unless `registry.require_staging` is off. `rollback(name)` moves production back to
the version before it in the promotion history. Within one hub, promotions of a model also
queue on an asyncio lock so two gates never run for it at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from dataclasses import dataclass

from hub.control import Control
from hub.errors import BadRequest, Conflict, HubError
from hub.validation import GateResult, ValidationGate
from registry.aliases import STAGES
from registry.errors import ConflictError
from registry.views import EventView

log = logging.getLogger(__name__)


class ValidationFailed(HubError):
    status_code = 422
    error_type = "validation_failed"


@dataclass(frozen=True)
class Promotion:
    event: EventView
    validation: GateResult


class Promoter:
    """Moves `staging` and `production`, through the validation gate.

    Contract: `promote` raises BadRequest for an unknown stage, Conflict when the alias is
    already there, staging was skipped (with `require_staging`) or another promotion moved the
    alias meanwhile, and ValidationFailed (422, the alias unchanged, the rejection audited)
    when the gate fails; on success the move is audited with the gate's result and this hub's
    catalog serves it before `promote` returns. `rollback` moves production back one step of
    its history, with the same compare-and-set.
    """

    def __init__(self, control: Control, gate: ValidationGate, *, require_staging: bool) -> None:
        self.control = control
        self.gate = gate
        self.require_staging = require_staging
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)

    async def promote(
        self, name: str, version: int, to: str, *, actor: str, reason: str = ""
    ) -> Promotion:
        if to not in STAGES:
            raise BadRequest(
                f"unknown stage {to!r}; promote to one of {', '.join(STAGES)}", param="to"
            )
        async with self._locks[name]:
            view = await self.control.version(name, version)
            current = (await self.control.model(name)).aliases.get(to)
            if current == version:
                raise Conflict(f"{name}@{to} already points to version {version}")
            if to == "production" and self.require_staging:
                passed = await self.control.passed_stage(name, version)
                if not passed:
                    raise Conflict(
                        f"{name} v{version} has not passed staging; promote it to staging first "
                        "(or set registry.require_staging: false)"
                    )
            result = await self.gate.run(view)
            await self.control.record_validation(name, version, result.as_dict())
            if not result.passed:
                await self.control.record_rejection(
                    name, to, version, current=current, actor=actor, reason=reason,
                    validation=result.as_dict(),
                )  # fmt: skip
                raise ValidationFailed(
                    f"{name} v{version} failed its validation gate; {to} is unchanged: "
                    + "; ".join(result.reasons),
                    code="validation_failed",
                )
            try:
                event = await self.control.move_alias(
                    name, to, version, actor=actor, reason=reason, action="promote",
                    validation=result.as_dict(), expected=current,
                )  # fmt: skip
            except ConflictError as e:
                raise Conflict(str(e)) from e
        return Promotion(event, result)

    async def rollback(self, name: str, *, actor: str, reason: str = "") -> EventView:
        async with self._locks[name]:
            try:
                current, previous = await self.control.rollback_target(name)
                event = await self.control.move_alias(
                    name, "production", previous, actor=actor, reason=reason,
                    action="rollback", expected=current,
                )  # fmt: skip
            except ConflictError as e:
                raise Conflict(str(e)) from e
        return event
