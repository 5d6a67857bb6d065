"""Cancelling a load while it runs in its worker thread, without torch.

The manager runs a load inside `cancellable(flag)`; the loading code calls `check_cancelled()`
between units of work (tensors read, parameters built, KV-cache layers allocated), which
raises LoadCancelled once the flag is set. The exception unwinds the load, dropping what it
had built. A contextvar carries the flag, so loading helpers need no extra argument and are
unaffected outside a cancellable load.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from contextvars import ContextVar

from backends.errors import LoadError


class LoadCancelled(LoadError):
    """The load was cancelled while it ran (its time ran out); what it had built is dropped
    with the exception."""


# The cancel flag of the load running in this thread (set by `cancellable`).
_cancel_flag: ContextVar[threading.Event | None] = ContextVar("load_cancel_flag", default=None)


@contextlib.contextmanager
def cancellable(flag: threading.Event) -> Iterator[None]:
    """Run a load inside this, in its worker thread: once `flag` is set, the load stops at
    its next `check_cancelled` (between tensors read, parameters built, KV-cache layers
    allocated) by raising LoadCancelled."""
    token = _cancel_flag.set(flag)
    try:
        yield
    finally:
        _cancel_flag.reset(token)


def check_cancelled() -> None:
    """Raise LoadCancelled if the load running in this thread was cancelled; a no-op
    outside `cancellable`."""
    flag = _cancel_flag.get()
    if flag is not None and flag.is_set():
        raise LoadCancelled("the load was cancelled: it ran past the manager's load_timeout")
