"""The residency table: the moves a model may make, and the one way to make them."""

from __future__ import annotations

import pytest

from hub.manager.planning import ModelKey
from hub.manager.residency import (
    TRANSITIONS,
    InvalidTransition,
    ModelState,
    can_move,
    check_transition,
)

pytestmark = pytest.mark.pure

S = ModelState


def test_the_table_is_the_lifecycle() -> None:
    assert set(TRANSITIONS) == set(ModelState)
    assert {s: sorted(TRANSITIONS[s]) for s in ModelState} == {
        S.UNLOADED: [S.LOADING],
        S.LOADING: [S.FAILED, S.LOADED, S.UNLOADED, S.WARM],
        S.LOADED: [S.EVICTING, S.FAILED, S.UNLOADED],  # failed: its device was lost
        S.EVICTING: [S.UNLOADED, S.WARM],
        S.WARM: [S.LOADING, S.UNLOADED],
        S.FAILED: [S.LOADING, S.UNLOADED],
    }


def test_every_state_is_reachable_and_every_state_can_reach_unloaded() -> None:
    seen, frontier = {S.UNLOADED}, [S.UNLOADED]
    while frontier:
        for nxt in TRANSITIONS[frontier.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                frontier.append(nxt)
    assert seen == set(ModelState)
    assert all(can_move(s, S.UNLOADED) for s in ModelState if s is not S.UNLOADED)


@pytest.mark.parametrize(
    ("current", "to"),
    [
        (S.UNLOADED, S.LOADED),  # never served without a load
        (S.LOADED, S.WARM),  # parked only through an eviction
        (S.EVICTING, S.LOADED),  # an eviction is never undone
        (S.WARM, S.LOADED),  # a restore is a load
        (S.FAILED, S.LOADED),
        (S.UNLOADED, S.UNLOADED),
        (S.LOADING, S.LOADING),  # one load at a time
    ],
)
def test_a_move_outside_the_table_raises_naming_the_model(current: S, to: S) -> None:
    assert not can_move(current, to)
    with pytest.raises(InvalidTransition) as e:
        check_transition(ModelKey("a", 3), current, to)
    assert str(e.value).startswith(f"a@3: {current} -> {to} is not allowed")


def test_an_allowed_move_returns_the_new_state() -> None:
    assert check_transition("a@1", S.WARM, S.LOADING) is S.LOADING


def test_an_entry_changes_state_only_through_the_table() -> None:
    from hub.manager.state import Entry

    entry = Entry(ModelKey("a", 1), "embedder")
    assert entry.state is S.UNLOADED
    entry.move(S.LOADING)
    with pytest.raises(InvalidTransition):
        entry.move(S.EVICTING)
    assert entry.state is S.LOADING  # a refused move changes nothing
    with pytest.raises(AttributeError):
        entry.state = S.LOADED  # type: ignore[misc]
