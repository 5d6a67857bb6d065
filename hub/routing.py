"""Which version of a model answers a request.

`model` in a request is a registered name, `name@version` or `name@alias`. A bare name is
served its default version: the `production` alias, else the latest version.
"""

from __future__ import annotations

from dataclasses import dataclass

from hub.catalog import Catalog
from hub.errors import BadRequest, NotFound


@dataclass(frozen=True)
class Route:
    name: str
    version: int
    kind: str
    # True when the caller named the version (`name@v`, `/versions/{v}/`), bypassing splits.
    pinned: bool = False


class Router:
    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog

    def route(self, model: str, *, route_key: str | None = None) -> Route:
        name, sep, ref = model.partition("@")
        if sep and not ref:
            raise BadRequest(f"model {model!r}: nothing after '@'", param="model")
        return self.route_version(name, ref) if sep else self._default(name)

    def route_version(self, name: str, ref: str) -> Route:
        """The version `ref` (a number or an alias) of `name`, bypassing traffic splits."""
        view = self.catalog.model(name)
        if ref.isdigit() and int(ref) in view.versions:
            return Route(name, int(ref), view.kind, pinned=True)
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

    def _default(self, name: str) -> Route:
        view = self.catalog.model(name)
        version = view.default_version()
        if version is None:
            raise NotFound(f"model {name!r} has no versions", param="model")
        return Route(name, version, view.kind)
