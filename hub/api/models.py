"""OpenAI's `GET /v1/models`: every registered model a client can name."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Depends
from pydantic import BaseModel

from hub.api.deps import CatalogDep, require_user

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


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


@router.get("/v1/models", response_model=ModelList)
async def list_models(catalog: CatalogDep) -> ModelList:
    snapshot = catalog.snapshot
    return ModelList(
        data=[
            ModelCard(
                id=m.name,
                created=int(m.created_at.timestamp()),
                kind=m.kind,
                default_version=m.default_version(),
                versions=sorted(m.versions),
                aliases=m.aliases,
            )
            for m in (snapshot.models[n] for n in snapshot.names())
            if m.versions
        ]
    )
