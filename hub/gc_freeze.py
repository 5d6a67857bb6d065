"""Keep Python's cyclic garbage collector off the serving path (`hub serve` only).

A hub's heap holds about half a million long-lived objects once it is up (torch,
transformers, MLflow, SQLAlchemy, the loaded models' modules). CPython's oldest-generation
collection walks every one of them with the GIL held, about 0.3-0.5 s on this project's
2-core machine, and it is triggered by allocation counts: under a burst of requests, exactly
when latency matters, the event loop and every forward thread stop for it. So once the
preloads have been attempted, `hub serve` collects once and freezes what is left
(`gc.freeze`: into a permanent generation no collection walks; vLLM does the same after its
start-up). What is allocated later (requests, models loaded later) is collected as usual.

A model that was loaded before the freeze and is unloaded later leaves its Python objects
that sit in reference cycles frozen (its tensors are freed by the backend's `unload` all the
same): at most one such shell per preloaded model, a bounded and small cost.
`collect_everything` is the full collection that reaches frozen objects too, for when
memory must come back (the manager's check that an unload returned device memory).
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger(__name__)

_frozen = False


def freeze() -> None:
    """Collect, then move every object still alive out of the collector's way."""
    global _frozen
    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    _frozen = True
    log.info(
        "froze %d start-up objects out of the garbage collector's way in %.2fs",
        gc.get_freeze_count(),
        time.perf_counter() - start,
    )


def collect_everything() -> None:
    """A full collection that reaches frozen objects too; what survives is frozen again."""
    if not _frozen:
        gc.collect()
        return
    gc.unfreeze()
    gc.collect()
    gc.freeze()
