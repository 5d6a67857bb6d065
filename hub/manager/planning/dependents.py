"""A LoRA adapter's dependency on its base model, as the planner sees it.

An adapter runs on its base's engine, so an adapter holding device memory (loading, loaded,
or leaving) keeps its base there. Its base's keep-alive does not run until every such
adapter has left; under pressure the base is an eviction candidate only when all of its
adapters are (a pinned, busy or loading adapter keeps its base as surely as a pin of its
own), and it is offered after them (`riders_first`), so adapters are evicted before their
base (an adapter costs milliseconds to bring back; the base a full load). Evicting the base
takes its adapters along. Pure: reads `Occupant.base` and `Candidate.base`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from hub.manager.planning.eviction import Candidate
from hub.manager.planning.keys import ModelKey
from hub.manager.planning.occupants import Occupant
from hub.manager.residency import ModelState

# States in which an adapter is on (or coming onto, or leaving) its base's engine.
_ON_BASE = frozenset({ModelState.LOADING, ModelState.LOADED, ModelState.EVICTING})


def riding(key: ModelKey, occupants: Mapping[ModelKey, Occupant]) -> list[ModelKey]:
    """The adapters of base `key` that are on its device now, in key order."""
    return sorted(k for k, o in occupants.items() if o.base == key and o.state in _ON_BASE)


def held_by_adapters(key: ModelKey, occupants: Mapping[ModelKey, Occupant]) -> str | None:
    """'adapters a@1, b@2 run on it' when adapters keep base `key` resident, else None."""
    keys = riding(key, occupants)
    if not keys:
        return None
    noun = "adapter" if len(keys) == 1 else "adapters"
    return f"{noun} {', '.join(map(str, keys))} run{'s' if len(keys) == 1 else ''} on it"


def riders_first(ordered: list[Candidate]) -> list[Candidate]:
    """`ordered` (a policy's order) with each base moved right after the last of its
    adapters among the candidates; everything else keeps its place."""
    remaining = Counter(c.base for c in ordered if c.base is not None)
    held: dict[ModelKey, Candidate] = {}
    out: list[Candidate] = []

    def put(c: Candidate) -> None:
        out.append(c)
        if c.base is not None:
            remaining[c.base] -= 1
            if remaining[c.base] == 0 and c.base in held:
                put(held.pop(c.base))

    for c in ordered:
        if remaining.get(c.key, 0) > 0:
            held[c.key] = c
        else:
            put(c)
    return out + list(held.values())
