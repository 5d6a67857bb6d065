"""Where a model version is: the residency states and the moves allowed between them.

Every state change of a model goes through `check_transition` (via `Entry.move`), so a move
the table does not allow is a bug that raises at once instead of leaving a model in a state
no code path expects. Pure Python: the planner and its tests import it without torch.

    unloaded --> loading --> loaded --> evicting --> warm --> loading (restore)
       ^  ^        |  |                   |           |
       |  |        |  +--> failed --------|-----------|---> loading (after a backoff)
       |  |        |           ^-- loaded (its device was lost)
       |  +--------+ (no room: back where it was)     |
       +-------------------------------------- <------+ (dropped from the host tier)

Shutdown (`ModelManager.close`) may take any state to `unloaded`.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping


class ModelState(enum.StrEnum):
    """The residency state of one model version (the `state` of `/admin/models`)."""

    LOADING = "loading"  # being loaded from disk or restored from the host tier
    LOADED = "loaded"  # resident on a device, serving
    WARM = "warm"  # weights parked in host memory, restorable by a copy
    EVICTING = "evicting"  # leaving its device (waiting for requests, offloading, unloading)
    FAILED = "failed"  # the last load failed; retried after a backoff
    UNLOADED = "unloaded"


_S = ModelState

# state -> the states it may move to. Shutdown's moves to UNLOADED are listed too.
TRANSITIONS: Mapping[ModelState, frozenset[ModelState]] = {
    # A request (or an admin load) starts a cold load.
    _S.UNLOADED: frozenset({_S.LOADING}),
    # Loaded; no room (back where it started: a warm copy stays parked); the load failed;
    # shutdown cancelled it.
    _S.LOADING: frozenset({_S.LOADED, _S.WARM, _S.UNLOADED, _S.FAILED}),
    # Pressure, keep-alive or an admin moves it off; shutdown unloads it directly; its
    # device stopped computing (failed, the backend gone with the device's context).
    _S.LOADED: frozenset({_S.EVICTING, _S.UNLOADED, _S.FAILED}),
    # Parked in the host tier, or dropped for good.
    _S.EVICTING: frozenset({_S.WARM, _S.UNLOADED}),
    # Restored by a request; dropped from the host tier (for room, by an admin, at shutdown).
    _S.WARM: frozenset({_S.LOADING, _S.UNLOADED}),
    # Retried once the backoff passed; shutdown forgets it.
    _S.FAILED: frozenset({_S.LOADING, _S.UNLOADED}),
}


class InvalidTransition(RuntimeError):
    """A state change the residency table does not allow: a bug in the manager, never a
    request's fault."""


def can_move(current: ModelState, to: ModelState) -> bool:
    """Whether `current -> to` is an allowed move."""
    return to in TRANSITIONS[current]


def check_transition(what: object, current: ModelState, to: ModelState) -> ModelState:
    """Return `to` if `current -> to` is allowed, else raise InvalidTransition naming `what`."""
    if not can_move(current, to):
        allowed = ", ".join(sorted(TRANSITIONS[current])) or "nothing"
        raise InvalidTransition(
            f"{what}: {current} -> {to} is not allowed (from {current}: {allowed})"
        )
    return to
