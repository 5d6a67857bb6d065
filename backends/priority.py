"""Priority classes: `interactive` ahead of `standard` ahead of `batch`, as scheduling levels.

Every backend orders its queue by an integer level, lower first (vLLM's convention for
`priority`). The three classes are the levels -1, 0 and 1, so a class is one level: the LLM
scheduler preempts a running sequence for a waiting one that outranks it by a level, and the
encoders' batchers seed each batch with the best-ranked waiting input. Integer priorities
(vLLM's field) are levels themselves, so `priority: 5` ranks below `batch`.

Who may ask for what is the hub's business (`hub.api.priority`); backends only compare levels.
"""

from __future__ import annotations

import enum


class PriorityClass(enum.StrEnum):
    INTERACTIVE = "interactive"
    STANDARD = "standard"
    BATCH = "batch"

    @property
    def level(self) -> int:
        """The scheduling level of the class (lower runs first)."""
        return _LEVELS[self]


_LEVELS = {PriorityClass.INTERACTIVE: -1, PriorityClass.STANDARD: 0, PriorityClass.BATCH: 1}


def aged_level(level: int, waited: int, aging: int) -> int:
    """`level` after waiting `waited` units (steps, batches) with one level gained per
    `aging` units: how a request that waits long enough comes to outrank newer ones."""
    return level - waited // aging
