"""The start-up heap frozen out of the cyclic collector's way (`hub serve`; the demo test
checks a served hub does it): a frozen reference cycle survives ordinary collections, and
`collect_everything` still frees it."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from hub import gc_freeze


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


@pytest.fixture
def frozen() -> Iterator[None]:
    gc_freeze.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
        gc_freeze._frozen = False


def _cycle() -> weakref.ref[Node]:
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_a_frozen_cycle_survives_collections_but_not_collect_everything(frozen: None) -> None:
    ref = _cycle()
    gc.freeze()  # as if it had been alive at start-up
    gc.collect()
    assert ref() is not None  # frozen: no collection walks it
    gc_freeze.collect_everything()
    assert ref() is None
    assert gc.get_freeze_count() > 0  # what survived is frozen again


def test_without_a_freeze_collect_everything_is_a_plain_collection() -> None:
    ref = _cycle()
    count = gc.get_freeze_count()
    gc_freeze.collect_everything()
    assert ref() is None and gc.get_freeze_count() == count
