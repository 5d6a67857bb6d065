"""Keep Python's cyclic garbage collector off the serving path (`hub serve` only).

A hub's heap holds about half a million long-lived objects once it is up (torch,
transformers, MLflow, SQLAlchemy, the loaded models' modules). CPython's oldest-generation
collection walks every one of them with the GIL held, about 0.3-0.5 s on this project's
2-core machine, and it is triggered by allocation counts: under a burst of requests, exactly
when latency matters, the event loop and every forward thread stop for it. So once the
preloads have been attempted, `hub serve` collects once and freezes what is left
(`gc.freeze`: into a permanent generation no collection walks; vLLM does the same after its
start-up). What is allocated later (requests, models loaded later) is collected as usual.
The collection runs on the event loop (it holds the GIL wherever it runs): one stall of a
few hundred milliseconds right after start-up.

A model that was loaded before the freeze and is unloaded later leaves its Python objects
that sit in reference cycles frozen (its tensors are freed by the backend's `unload` all the
same): a bounded and small cost. `collect_everything` is the full collection that reaches
frozen objects too, for when memory must come back (the manager's check that an unload
returned device memory); it freezes what survives again, whatever was alive then, so after
one the frozen set is no longer only the start-up heap.
"""

from __future__ import annotations

import gc
import logging
import threading
import time

log = logging.getLogger(__name__)

_frozen = False
# One unfreeze-collect-freeze at a time: two interleaved would freeze again before the other
# collected, and it would miss the cycles it came for.
_collecting = threading.Lock()


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
    with _collecting:
        if not _frozen:
            gc.collect()
            return
        gc.unfreeze()
        gc.collect()
        gc.freeze()
