"""Pure planning for the model manager: who goes where, who leaves, and why not.

Keys, the per-device ledger, the host tier's accounting, placement, eviction policies, the
room broker and the explanations of memory pressure, composed by `Planner`. This package
decides and never does: no awaits on model work, no I/O. It imports only the standard
library, `hub.units` and `hub.manager.residency` (no torch, SQLAlchemy, Prometheus, FastAPI
or pydantic), so it imports and is tested in a bare environment.
"""

from hub.manager.planning.eviction import (
    POLICIES,
    Candidate,
    EvictionPolicy,
    GreedyDualSizeFrequency,
    LargestFirst,
    LeastRecentlyUsed,
    choose_victims,
    make_policy,
)
from hub.manager.planning.host_tier import HostTier
from hub.manager.planning.keys import ModelKey
from hub.manager.planning.ledger import MemoryLedger, OverBudget
from hub.manager.planning.occupants import Occupant, evictable, idle_loaded, why_held
from hub.manager.planning.placement import Placement, place
from hub.manager.planning.planner import Planner
from hub.manager.planning.pressure import NoRoom, check_feasible, describe_room, needs_text
from hub.manager.planning.room import RoomBroker, RoomRequest

__all__ = [
    "POLICIES",
    "Candidate",
    "EvictionPolicy",
    "GreedyDualSizeFrequency",
    "HostTier",
    "LargestFirst",
    "LeastRecentlyUsed",
    "MemoryLedger",
    "ModelKey",
    "NoRoom",
    "Occupant",
    "OverBudget",
    "Placement",
    "Planner",
    "RoomBroker",
    "RoomRequest",
    "check_feasible",
    "choose_victims",
    "describe_room",
    "evictable",
    "idle_loaded",
    "make_policy",
    "needs_text",
    "place",
    "why_held",
]
