"""The router directly (no HTTP): default versions, `name@version` / `name@alias`, traffic
splits with sticky keys, splits across models, stale policies."""

from __future__ import annotations

from collections import Counter

import pytest

from hub.catalog import Catalog
from hub.errors import BadRequest, NotFound
from hub.routing import Router
from registry.views import SplitView, TrafficPolicyView
from tests.support.snapshots import SnapshotSource, model_view, snapshot


async def router_for(*models, traffic=None) -> Router:  # type: ignore[no-untyped-def]
    source = SnapshotSource(snapshot(*models, traffic=traffic))
    catalog = Catalog(source)  # type: ignore[arg-type]
    await catalog.refresh()
    return Router(catalog)


def split(name: str, *weights: tuple[int, float], model: str | None = None) -> TrafficPolicyView:
    return TrafficPolicyView(name, splits=tuple(SplitView(model or name, v, w) for v, w in weights))


async def test_a_bare_name_is_served_production_else_the_latest() -> None:
    router = await router_for(
        model_view("emb", versions=3, aliases={"production": 2}), model_view("rr", versions=2)
    )
    route = router.route("emb")
    assert (route.name, route.version, route.kind, route.pinned, route.split) == (
        "emb", 2, "embedder", False, False,
    )  # fmt: skip
    assert router.route("rr").version == 2


async def test_name_at_version_and_name_at_alias_bypass_the_split() -> None:
    router = await router_for(
        model_view("emb", versions=3, aliases={"production": 1, "candidate": 3}),
        traffic=[split("emb", (1, 0), (2, 100))],
    )
    assert router.route("emb").version == 2  # the split
    by_number, by_alias = router.route("emb@1"), router.route("emb@candidate")
    assert (by_number.version, by_number.pinned, by_number.split) == (1, True, False)
    assert (by_alias.version, by_alias.pinned) == (3, True)
    assert router.route_version("emb", "production").version == 1


async def test_unknown_references_are_clear_errors() -> None:
    router = await router_for(model_view("emb", versions=2, aliases={"production": 1}))
    with pytest.raises(NotFound, match=r"no version or alias '7' \(versions: 1, 2; aliases: "
                                       r"production->1\)"):  # fmt: skip
        router.route("emb@7")
    with pytest.raises(BadRequest, match="nothing after '@'"):
        router.route("emb@")
    with pytest.raises(NotFound, match="does not exist"):
        router.route("other")


async def test_a_split_keeps_each_key_on_one_version_and_shares_by_weight() -> None:
    router = await router_for(
        model_view("emb", versions=2, aliases={"production": 1}),
        traffic=[split("emb", (1, 90), (2, 10))],
    )
    keys = [f"user-{i}" for i in range(4000)]
    first = {k: router.route("emb", route_key=k).version for k in keys}
    again = {k: router.route("emb", route_key=k).version for k in keys}
    assert first == again  # sticky
    assert all(router.route("emb", route_key=k).split for k in keys[:10])
    share = Counter(first.values())[2] / len(keys)
    assert 0.07 < share < 0.13  # 10% of keys, up to the hash's sampling noise
    table = router.table("emb")
    assert table is not None
    assert {arm.version: round(s, 1) for arm, s in table.shares().items()} == {1: 0.9, 2: 0.1}


async def test_raising_a_weight_moves_keys_only_towards_that_version() -> None:
    keys = [f"user-{i}" for i in range(2000)]
    before = await router_for(
        model_view("emb", versions=2), traffic=[split("emb", (1, 90), (2, 10))]
    )
    after = await router_for(
        model_view("emb", versions=2), traffic=[split("emb", (1, 75), (2, 25))]
    )
    was = {k: before.route("emb", route_key=k).version for k in keys}
    now = {k: after.route("emb", route_key=k).version for k in keys}
    moved = [(was[k], now[k]) for k in keys if was[k] != now[k]]
    assert moved and all(m == (1, 2) for m in moved)


async def test_a_split_to_another_model_names_it_in_the_label() -> None:
    router = await router_for(
        model_view("emb"), model_view("emb-large"),
        traffic=[split("emb", (1, 100), model="emb-large")],
    )  # fmt: skip
    route = router.route("emb")
    assert (route.name, route.via, route.public_name, route.label) == (
        "emb-large", "emb", "emb", "emb-large@1",
    )  # fmt: skip


async def test_a_stale_split_never_routes_to_a_version_that_is_gone() -> None:
    router = await router_for(
        model_view("emb", versions=2, aliases={"production": 1}),
        traffic=[split("emb", (1, 50), (3, 50))],  # v3 is not (or no longer) registered
    )
    assert router.table("emb") is None
    assert {router.route("emb", route_key=f"k{i}").version for i in range(50)} == {1}
