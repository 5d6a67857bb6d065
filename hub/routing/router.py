"""Which version of a model answers a request.

`model` in a request is a registered name, `name@version` or `name@alias`. A bare name is
served by its traffic split when it has one (see hub.routing.assignment: a sticky bucket
from the routing key, weighted over versions), else its default version: the `production`
alias, else the latest. `name@version`, `name@alias` and `/versions/{v}/` bypass the split.
"""

from __future__ import annotations

from dataclasses import dataclass

from hub.catalog import Catalog
from hub.errors import BadRequest, NotFound
from hub.routing.assignment import Arm, AssignmentTable, bucket_of, random_bucket
from registry.refs import version_number
from registry.views import ModelView, SplitView


@dataclass(frozen=True)
class Route:
    """The version chosen for one request, and how it was chosen."""

    name: str
    version: int
    kind: str
    # True when the caller named the version (`name@v`, `/versions/{v}/`), bypassing splits.
    pinned: bool = False
    # True when the model's traffic split chose this version (the sample-ratio check counts
    # only these).
    split: bool = False
    # The name the caller asked for, when its split sent the request to a version of another
    # model of the same kind; None when that is `name` itself.
    via: str | None = None

    @property
    def public_name(self) -> str:
        """The model name the caller used; its traffic policy and readout cover this route."""
        return self.via or self.name

    @property
    def label(self) -> str:
        """The served version as `X-Hub-Model-Version` and readouts name it: `3`, or
        `other@3` for another model's version under this public name."""
        return str(self.version) if self.via is None else f"{self.name}@{self.version}"


class Router:
    """Picks the version that answers a request, from the catalog's snapshot alone (no I/O).

    Contract: `route(model, route_key=...)` accepts `name`, `name@version` and `name@alias`;
    a bare name follows the model's traffic split (the same key always lands on the same
    version while the weights stay) or else its default version; a split naming a version no
    longer in the catalog is ignored. Unknown names and references raise NotFound naming
    what exists; `name@` raises BadRequest.
    """

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog
        # Assignment tables by model, rebuilt only when its split changes.
        self._tables: dict[str, tuple[tuple[SplitView, ...], AssignmentTable]] = {}

    def route(self, model: str, *, route_key: str | None = None) -> Route:
        """Route a request for `model`; `route_key` (the X-Hub-Route-Key header or OpenAI's
        `user`) keeps a caller on one version of a split; without it the bucket is random."""
        name, sep, ref = model.partition("@")
        if sep and not ref:
            raise BadRequest(f"model {model!r}: nothing after '@'", param="model")
        return self.route_version(name, ref) if sep else self._routed(name, route_key)

    def route_version(self, name: str, ref: str) -> Route:
        """The version `ref` (a number or an alias) of `name`, bypassing traffic splits."""
        view = self.catalog.model(name)
        number = version_number(ref)  # ASCII digits only: "²" is no version number
        if number is not None and number in view.versions:
            return Route(name, number, view.kind, pinned=True)
        if ref in view.aliases and view.aliases[ref] in view.versions:
            return Route(name, view.aliases[ref], view.kind, pinned=True)
        versions = ", ".join(str(v) for v in sorted(view.versions)) or "none"
        aliases = ", ".join(f"{a}->{v}" for a, v in sorted(view.aliases.items())) or "none"
        raise NotFound(
            f"model {name!r} has no version or alias {ref!r} "
            f"(versions: {versions}; aliases: {aliases})",
            param="model",
            code="model_not_found",
        )

    def table(self, name: str) -> AssignmentTable | None:
        """The assignment table of `name`'s current split; None when it has none (or none
        whose versions are all still in the catalog)."""
        policy = self.catalog.snapshot.traffic.get(name)
        if policy is None or not any(s.weight > 0 for s in policy.splits):
            return None
        cached = self._tables.get(name)
        if cached is not None and cached[0] == policy.splits:
            return cached[1]
        models = self.catalog.snapshot.models
        for split in policy.splits:
            target = models.get(split.model)
            if target is None or split.version not in target.versions:
                return None  # a stale policy never routes to something that is gone
        weights = [(Arm(s.model, s.version), s.weight) for s in policy.splits]
        table = AssignmentTable(name, weights)
        self._tables[name] = (policy.splits, table)
        return table

    def _routed(self, name: str, route_key: str | None) -> Route:
        view = self.catalog.model(name)
        table = self.table(name)
        if table is None:
            return self._default(view)
        bucket = bucket_of(name, route_key) if route_key else random_bucket()
        arm = table.arm(bucket)
        target = self.catalog.snapshot.models.get(arm.model)
        if target is None:  # the table outlived its target's registration: serve the default
            return self._default(view)
        via = None if arm.model == name else name
        return Route(arm.model, arm.version, target.kind, split=True, via=via)

    @staticmethod
    def _default(view: ModelView) -> Route:
        version = view.default_version()
        if version is None:
            raise NotFound(f"model {view.name!r} has no versions", param="model")
        return Route(view.name, version, view.kind)


class DecidedRouter(Router):
    """The router of one request whose version was already decided: by placement on this
    replica, or by the replica that forwarded the request here. Routing `decided`'s public
    name (bare, or with a reference) answers `decided`, so a request is routed exactly once
    across replicas; anything else routes as usual."""

    def __init__(self, base: Router, decided: Route) -> None:
        self.catalog = base.catalog
        self._tables = base._tables
        self.decided = decided

    def route(self, model: str, *, route_key: str | None = None) -> Route:
        if model.partition("@")[0] == self.decided.public_name:
            return self.decided
        return super().route(model, route_key=route_key)
