"""Which requests a failed engine step is to blame on, so one bad request fails alone.

A step packs every scheduled sequence into one forward pass and one sampler call, so an error
in any sequence's part (its inputs, its sampling settings) surfaces as the whole step's
exception. `find_culprits` re-prepares each scheduled sequence by itself, without running the
model and without touching the runner's sampler state (`ModelRunner.check_sequence`), and
names the requests whose preparation alone raises. The engine then fails those requests and
keeps the others; an error no sequence reproduces alone (the model itself raised, the device
failed) is the step's, and fails every request in it.
"""

from __future__ import annotations

import logging
from typing import Protocol

from backends.errors import InputError
from backends.llm.scheduler import ScheduledSequence, SchedulerOutput

log = logging.getLogger(__name__)


class SequenceChecker(Protocol):
    def check_sequence(self, item: ScheduledSequence) -> None:
        """Raise whatever preparing `item` alone for a step raises; change nothing."""


class RequestFailedError(InputError):
    """A request's own inputs or sampling settings broke the engine step it was in; the
    other requests of that step go on. An InputError: the caller's 400, since nothing but
    this request's values reproduces the failure."""

    def __init__(self, request_id: str, cause: BaseException) -> None:
        super().__init__(
            f"this request could not be prepared for the model ({type(cause).__name__}: "
            f"{cause}); check its sampling values and prompt. Other requests were not affected"
        )
        self.request_id = request_id


def find_culprits(runner: SequenceChecker, output: SchedulerOutput) -> dict[str, BaseException]:
    """request id -> the error its scheduled sequences raise when prepared alone."""
    culprits: dict[str, BaseException] = {}
    for item in output.scheduled:
        request_id = item.seq.request_id
        if request_id in culprits:
            continue
        try:
            runner.check_sequence(item)
        except Exception as e:  # any error this sequence raises alone is its own
            log.warning("request %s fails the engine step by itself: %r", request_id, e)
            culprits[request_id] = e
    return culprits


def blame_is_attributable(culprits: dict[str, BaseException], output: SchedulerOutput) -> bool:
    """Whether failing only `culprits` is right. When every request of a multi-request step
    fails alone too, the cause is shared (the device, the model), not any one request's."""
    if not culprits:
        return False
    scheduled = {item.seq.request_id for item in output.scheduled}
    return len(scheduled) == 1 or not scheduled <= culprits.keys()
