"""The catalog directly: refresh swaps the snapshot and tells listeners of changes only;
lookups name what exists."""

from __future__ import annotations

from typing import Any

import pytest

from hub.catalog import Catalog
from hub.errors import NotFound
from registry.views import RegistrySnapshot
from tests.support.snapshots import SnapshotSource, model_view, snapshot


def make() -> tuple[Catalog, SnapshotSource]:
    source = SnapshotSource()
    return Catalog(source), source  # type: ignore[arg-type]


async def test_refresh_serves_the_new_snapshot_and_tells_listeners_of_changes_only() -> None:
    catalog, source = make()
    changes: list[tuple[list[str], list[str]]] = []

    async def listener(old: RegistrySnapshot, new: RegistrySnapshot) -> None:
        changes.append((old.names(), new.names()))

    catalog.on_change(listener)
    assert catalog.snapshot.models == {}
    source.current = snapshot(model_view("emb"))
    await catalog.refresh()
    assert catalog.snapshot.names() == ["emb"]
    await catalog.refresh()  # same registry state: no change to report
    source.current = snapshot(model_view("emb"), model_view("rr", "reranker"))
    await catalog.refresh()
    assert changes == [([], ["emb"]), (["emb"], ["emb", "rr"])]
    assert source.reads == 3


async def test_a_failing_listener_does_not_stop_the_others() -> None:
    catalog, source = make()
    seen: list[str] = []

    async def broken(old: Any, new: Any) -> None:
        raise RuntimeError("listener bug")

    async def fine(old: Any, new: Any) -> None:
        seen.append("called")

    catalog.on_change(broken)
    catalog.on_change(fine)
    source.current = snapshot(model_view("emb"))
    assert (await catalog.refresh()).names() == ["emb"]
    assert seen == ["called"]


async def test_lookup_of_an_unknown_model_names_the_known_ones() -> None:
    catalog, source = make()
    source.current = snapshot(model_view("emb"), model_view("chat", "llm"))
    await catalog.refresh()
    assert catalog.model("chat").kind == "llm"
    with pytest.raises(NotFound, match=r"'nope' does not exist \(known models: chat, emb\)"):
        catalog.model("nope")
