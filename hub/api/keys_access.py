"""Model access: a key whose policy names `models` may use only those.

A grant is a model name (every version of it, LoRA adapters being models of their own) or
`name@version` / `name@alias` (that version only; an alias is read when the request comes,
so a grant of `name@production` follows the alias as it moves). A request for a model the
key may not use is answered exactly as one for a model that does not exist: the same 404,
listing only the models the key may use, so a key learns nothing of what else is served.

Enforced in one place, the router a request routes with (`routes_for`, used by
`hub.api.deps.get_router` and by the ingress's placement): whatever the route, the model is
resolved through it, so no route can forget the check.
"""

from __future__ import annotations

from hub.auth import Caller
from hub.catalog import Catalog
from hub.errors import NotFound
from hub.routing import Route, Router
from registry.refs import version_number


class Grants:
    """The models of one key's policy: by name, the references granted (None: every
    version)."""

    def __init__(self, models: tuple[str, ...]) -> None:
        self.by_name: dict[str, set[str] | None] = {}
        for model in models:
            name, sep, ref = model.partition("@")
            refs = self.by_name.get(name, set())
            if not sep:
                self.by_name[name] = None  # the whole model: any version grant is moot
            elif refs is not None:
                self.by_name[name] = refs | {ref}

    def names(self, name: str) -> bool:
        """Whether the key may use some version of `name`."""
        return name in self.by_name

    def check_name(self, catalog: Catalog, name: str) -> None:
        """NotFound, worded as for an unknown model, when the key may not use `name`."""
        if name not in self.by_name:
            raise unknown_model(catalog, name, self)

    def check_route(self, catalog: Catalog, name: str, route: Route) -> None:
        """NotFound when `route` (routed for `name`) serves a version the key may not use."""
        refs = self.by_name.get(name)
        if refs is None:
            return
        view = catalog.snapshot.models.get(name)
        allowed = set()
        for ref in refs:
            number = version_number(ref)
            if number is None and view is not None:
                number = view.aliases.get(ref)
            if number is not None:
                allowed.add(number)
        if route.name != name or route.version not in allowed:
            granted = ", ".join(f"{name}@{r}" for r in sorted(refs))
            raise NotFound(
                f"model {name!r}: this key may use only {granted}, not version {route.version}",
                param="model",
                code="model_not_found",
            )


def unknown_model(catalog: Catalog, name: str, grants: Grants | None) -> NotFound:
    """The 404 of a model that does not exist, as the catalog words it, listing only what
    `grants` allow (every model when None)."""
    names = catalog.snapshot.names()
    known = ", ".join(n for n in names if grants is None or grants.names(n)) or "none"
    return NotFound(
        f"model {name!r} does not exist (known models: {known})",
        param="model",
        code="model_not_found",
    )


def grants_of(caller: Caller | None) -> Grants | None:
    """The caller's grants; None when it may use every model."""
    if caller is None or caller.policy.models is None:
        return None
    return Grants(caller.policy.models)


def routes_for(router: Router, caller: Caller | None) -> Router:
    """`router` itself for a caller that may use every model, else a `GrantedRouter`."""
    grants = grants_of(caller)
    return router if grants is None else GrantedRouter(router, grants)


class GrantedRouter(Router):
    """Routes as `base` does, for the models of `grants` only: anything else raises the
    NotFound of an unknown model, before the base router looks at it (whose own 404s would
    name versions and aliases)."""

    def __init__(self, base: Router, grants: Grants) -> None:
        self.catalog = base.catalog
        self._tables = base._tables
        self.base = base
        self.grants = grants

    def route(self, model: str, *, route_key: str | None = None) -> Route:
        name = model.partition("@")[0]
        self.grants.check_name(self.catalog, name)
        route = self.base.route(model, route_key=route_key)
        self.grants.check_route(self.catalog, name, route)
        return route

    def route_version(self, name: str, ref: str) -> Route:
        self.grants.check_name(self.catalog, name)
        route = self.base.route_version(name, ref)
        self.grants.check_route(self.catalog, name, route)
        return route
