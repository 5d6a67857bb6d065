"""The placement decision: where one request for a model version is served, from what this
replica holds and what its peers' heartbeats say."""

from __future__ import annotations

import pytest

from hub.placement.decision import PlacementPolicy, Replica, decide, spare_copies

pytestmark = pytest.mark.pure

MiB = 2**20
POLICY = PlacementPolicy(max_queue_depth=8)
SIZE = 100 * MiB


def here(state: str | None = None, free: int = 0, id: str = "b") -> Replica:
    return Replica(id, state, free)


def peer(id: str, state: str | None = None, free: int = 0, queue: int = 0) -> Replica:
    return Replica(id, state, free, queue, address=f"http://{id}:8000")


def ids(peers: tuple[Replica, ...]) -> list[str]:
    return [p.id for p in peers]


def test_alone_everything_is_served_here() -> None:
    for state in (None, "loaded", "warm"):
        for free in (0, 10 * SIZE):
            assert decide(here(state, free), [], SIZE, POLICY).here


def test_held_here_and_nowhere_else_is_served_here() -> None:
    d = decide(here("loaded"), [peer("a", free=SIZE * 5), peer("c")], SIZE, POLICY)
    assert (d.here, d.reason) == (True, "resident_here")


def test_a_peer_holding_it_serves_it_instead_of_a_load_here() -> None:
    d = decide(here(None, free=10 * SIZE), [peer("c", "loaded"), peer("a")], SIZE, POLICY)
    assert ids(d.peers) == ["c"] and d.reason == "resident_peer" and d.avoids_load


def test_a_peer_still_loading_it_is_joined_rather_than_loading_a_second_copy() -> None:
    d = decide(here(None, free=10 * SIZE), [peer("c", "loading")], SIZE, POLICY)
    assert ids(d.peers) == ["c"]


def test_two_copies_every_replica_sends_to_the_same_one() -> None:
    # A race left copies on a and b: all three replicas pick a, so b's copy goes idle.
    a, b, c = peer("a", "loaded"), peer("b", "loaded"), peer("c")
    assert ids(decide(here("loaded", id="b"), [a, c], SIZE, POLICY).peers) == ["a"]
    assert decide(here("loaded", id="a"), [b, c], SIZE, POLICY).here
    assert ids(decide(here(None, id="c"), [a, b], SIZE, POLICY).peers)[0] == "a"


def test_a_loaded_copy_is_preferred_to_one_still_loading() -> None:
    d = decide(here("loading", id="b"), [peer("a", "loading"), peer("c", "loaded")], SIZE, POLICY)
    assert ids(d.peers) == ["c", "a"]
    assert decide(here("loaded", id="b"), [peer("a", "loading")], SIZE, POLICY).here


def test_a_busy_holder_is_skipped() -> None:
    busy = peer("a", "loaded", queue=POLICY.max_queue_depth)
    assert decide(here("loaded", id="b"), [busy], SIZE, POLICY).here
    d = decide(here(None, free=10 * SIZE), [busy, peer("c", "loaded", queue=3)], SIZE, POLICY)
    assert ids(d.peers) == ["c"]
    # Every holder busy and nothing here: loaded here, as without placement.
    assert decide(here(None, free=10 * SIZE), [busy], SIZE, POLICY).reason == "fits_here"


def test_resident_beats_warm_and_warm_beats_a_cold_load() -> None:
    d = decide(
        here("warm", free=SIZE), [peer("a", "warm", SIZE), peer("c", "loaded")], SIZE, POLICY
    )
    assert ids(d.peers) == ["c", "a"] and d.reason == "resident_peer"
    d = decide(here("warm", free=SIZE), [peer("a", "warm", free=SIZE)], SIZE, POLICY)
    assert d.reason == "warm_here"
    d = decide(here(None, free=10 * SIZE), [peer("c", "warm", free=SIZE), peer("a")], SIZE, POLICY)
    assert ids(d.peers) == ["c"] and d.reason == "warm_peer" and d.avoids_load


def test_a_warm_copy_on_a_full_replica_loses_to_room_elsewhere() -> None:
    # Restoring it where it is would evict a model in use; a replica with room takes it.
    d = decide(here("warm", free=0), [peer("a", free=2 * SIZE)], SIZE, POLICY)
    assert ids(d.peers) == ["a"] and d.reason == "room_peer"
    d = decide(here(None, free=SIZE), [peer("a", "warm", free=0)], SIZE, POLICY)
    assert d.reason == "fits_here"


def test_no_room_anywhere_a_warm_copy_is_restored_rather_than_a_cold_load() -> None:
    assert decide(here("warm"), [peer("a", "warm")], SIZE, POLICY).reason == "warm_here"
    d = decide(here(None), [peer("c", "warm"), peer("a")], SIZE, POLICY)
    assert ids(d.peers) == ["c"] and d.reason == "warm_peer"


def test_a_warm_copy_is_the_fallback_when_the_resident_holder_is_gone() -> None:
    d = decide(here(None), [peer("a", "loaded"), peer("c", "warm")], SIZE, POLICY)
    assert ids(d.peers) == ["a", "c"]


def test_nobody_holds_it_and_it_fits_here_it_loads_here() -> None:
    d = decide(here(None, free=SIZE), [peer("a", free=10 * SIZE)], SIZE, POLICY)
    assert (d.here, d.reason) == (True, "fits_here")


def test_a_load_that_would_evict_here_goes_to_the_peer_with_the_most_room() -> None:
    peers = [peer("a", free=2 * SIZE), peer("c", free=3 * SIZE), peer("d", free=SIZE // 2)]
    d = decide(here(None, free=SIZE // 2), peers, SIZE, POLICY)
    assert ids(d.peers) == ["c", "a"] and d.reason == "room_peer" and not d.avoids_load


def test_a_copy_served_elsewhere_counts_as_room() -> None:
    # b and c both hold m; rule 1 serves it at b, so c's copy is spare.
    assert spare_copies({"m": ["c", "b"], "n": ["a"]}) == {"c": ["m"]}
    spare = Replica("c", None, free_bytes=0, spare_bytes=SIZE, address="http://c:8000")
    d = decide(here(None, free=0, id="a"), [peer("b"), spare], SIZE, POLICY)
    assert ids(d.peers) == ["c"] and d.reason == "room_peer"


def test_nobody_has_room_it_loads_here_evicting() -> None:
    d = decide(here(None, free=0), [peer("a", free=SIZE // 2)], SIZE, POLICY)
    assert (d.here, d.reason) == (True, "evict_here")


def test_an_unknown_size_loads_here() -> None:
    d = decide(here(None, free=0), [peer("a", free=10 * SIZE)], None, POLICY)
    assert d.here


def test_this_replica_listed_among_peers_is_ignored() -> None:
    d = decide(here(None, free=SIZE, id="b"), [peer("b", "loaded")], SIZE, POLICY)
    assert d.reason == "fits_here"
