"""OpenAI's `GET /v1/models` (every registered model a client can name) and
`GET /v1/models/{id}` (one of them; `name@version` or `name@alias` for one version). A key
limited to some models sees only those (hub.api.keys_access)."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Depends
from pydantic import BaseModel

from hub.api.deps import CallerDep, CatalogDep, HubDep, require_user
from hub.api.keys_access import grants_of, routes_for
from hub.errors import NotFound
from registry.views import ModelView

router = APIRouter(tags=["models"], dependencies=[Depends(require_user)])


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "model-hub"
    # Extensions: what kind of model it is and which version a bare name is served.
    kind: str
    default_version: int | None
    versions: list[int]
    aliases: dict[str, int]
    # A LoRA adapter's base (`name@version`) for its default version, as vLLM names it.
    parent: str | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def _card(m: ModelView, model_id: str | None = None) -> ModelCard:
    default = m.default_version()
    base = m.versions[default].base if default is not None else None
    return ModelCard(
        id=model_id or m.name,
        created=int(m.created_at.timestamp()),
        kind=m.kind,
        default_version=default,
        versions=sorted(m.versions),
        aliases=m.aliases,
        parent=str(base) if base is not None else None,
    )


@router.get("/v1/models", response_model=ModelList)
async def list_models(catalog: CatalogDep, caller: CallerDep) -> ModelList:
    snapshot = catalog.snapshot
    grants = grants_of(caller)
    names = [n for n in snapshot.names() if grants is None or grants.names(n)]
    return ModelList(data=[_card(m) for m in (snapshot.models[n] for n in names) if m.versions])


# `:path` so that a name holding a slash (`org/model`) reaches this route whole.
@router.get("/v1/models/{model_id:path}", response_model=ModelCard)
async def retrieve_model(model_id: str, hub: HubDep, caller: CallerDep) -> ModelCard:
    """The model as `/v1/models` lists it, 404 for an unknown one (or one the caller's key
    may not use); `name@3` or `name@alias` answers for that one version (404 when the model
    has no such version)."""
    name, sep, _ = model_id.partition("@")
    grants = grants_of(caller)
    if grants is not None:
        grants.check_name(hub.catalog, name)
    view = hub.catalog.model(name)
    if sep:
        # Refuses (404, listing what exists) a version it lacks or the key may not use.
        routes_for(hub.router, caller).route(model_id)
    elif not view.versions:
        raise NotFound(f"model {name!r} has no versions", param="model", code="model_not_found")
    return _card(view, model_id)
