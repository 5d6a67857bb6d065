"""How large the CPU's caches are, and whether a model's weights outgrow them (the fused
step then reads them ahead non-temporally: `prefetch_weights` in csrc/tiles.h)."""

from __future__ import annotations

import functools
import os

_CPU_CACHES = "/sys/devices/system/cpu/cpu0/cache"


@functools.cache
def last_level_cache_bytes() -> int | None:
    """The size of the CPU's largest cache (L3 on a server; what sysfs reports for CPU 0, else
    glibc's `sysconf`), None where neither says."""
    sizes = []
    try:
        for index in os.listdir(_CPU_CACHES):
            if index.startswith("index"):
                with open(os.path.join(_CPU_CACHES, index, "size")) as f:
                    text = f.read().strip().upper()
                scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
                sizes.append(int(text.rstrip("KMG")) * scale)
    except (OSError, ValueError):
        sizes = []
    if not sizes:
        for name in ("SC_LEVEL3_CACHE_SIZE", "SC_LEVEL2_CACHE_SIZE"):
            try:
                size = os.sysconf(name)
            except (OSError, ValueError):
                continue
            if size > 0:
                sizes.append(size)
    return max(sizes) if sizes else None


def streams_weights(weight_bytes: int, cache_bytes: int | None) -> bool:
    """Whether a step reads its weights ahead non-temporally (`prefetch_weights` in
    csrc/tiles.h): where they outgrow the last-level cache, every step reads all of them
    from memory anyway, and keeping them out of the caches leaves those to what does come
    back each step (the Python around the step, the event loop, a draft model's weights).
    A model that fits keeps its weights cached; an unknown cache size changes nothing."""
    return cache_bytes is not None and weight_bytes > cache_bytes
