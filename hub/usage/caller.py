"""Who a request is metered under: the caller the user-key check named.

The check runs in the route's body dependency (hub.api.bodies), `serve()` further down the
same request's task: the name travels in that request's context (a `ContextVar`: each
request's task has its own, and the tasks a streamed answer starts copy it), so no route
has to pass it along. `caller_name` is the one place that reads what
`Authenticator.check` returns.
"""

from __future__ import annotations

from contextvars import ContextVar

# The caller with auth off, or when no key was checked.
ANONYMOUS = "anonymous"

_CALLER: ContextVar[str] = ContextVar("hub_usage_caller", default=ANONYMOUS)


def caller_name(checked: object) -> str:
    """The caller's name in what `Authenticator.check` returned: the name itself, or an
    object carrying it as `.name`."""
    name = getattr(checked, "name", checked)
    return name if isinstance(name, str) and name else ANONYMOUS


def note_caller(checked: object) -> None:
    """Meter the rest of this request under the caller `checked` names."""
    _CALLER.set(caller_name(checked))


def current_caller() -> str:
    """The caller this request is metered under (ANONYMOUS when none was noted)."""
    return _CALLER.get()
