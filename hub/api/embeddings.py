"""Embeddings: OpenAI's `POST /v1/embeddings` and the per-model `/embed` routes."""

from __future__ import annotations

import base64
from typing import Annotated, Literal

import numpy as np
from fastapi import APIRouter, Depends, Response
from pydantic import BaseModel, ConfigDict, Field, field_validator

from backends.embedder import EmbedderBackend
from hub.api.deps import HubDep, RouteKey, require_user
from hub.api.serving import KeepAlive, require_kind, serve
from hub.errors import BadRequest
from hub.routing import Route
from hub.state import Hub
from hub.traffic.replays import EmbeddingReplay
from hub.traffic.request import mirror_to_shadow, report_tokens

router = APIRouter(tags=["embeddings"], dependencies=[Depends(require_user)])

EmbeddingInput = str | list[str] | list[int] | list[list[int]]


class EmbedBody(BaseModel):
    """The body of the per-model routes: the OpenAI request without `model`."""

    model_config = ConfigDict(extra="forbid")

    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(gt=0)] | None = None
    user: str | None = None
    # Extensions: refuse over-long inputs instead of truncating them; Ollama's keep_alive.
    truncate: bool = True
    keep_alive: KeepAlive = None

    @field_validator("input")
    @classmethod
    def _not_empty(cls, v: EmbeddingInput) -> EmbeddingInput:
        if isinstance(v, list) and not v:
            raise ValueError("input must not be an empty list")
        if isinstance(v, list) and any(isinstance(x, list) and not x for x in v):
            raise ValueError("input must not contain an empty token list")
        return v


class EmbeddingCreate(EmbedBody):
    model: str


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingPublic(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


def _texts(value: EmbeddingInput) -> list[str]:
    if isinstance(value, str):
        return [value]
    if all(isinstance(x, str) for x in value):
        return list(value)  # type: ignore[arg-type]
    raise BadRequest(
        "token-id input is not supported by this model's backend; send strings",
        param="input",
    )


def _encode(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode()
    return vector.astype(np.float32).tolist()


async def _embed(hub: Hub, route: Route, body: EmbedBody, response: Response) -> EmbeddingPublic:
    require_kind(route, "embedder", "embeddings")
    texts = _texts(body.input)
    async with serve(hub, route, "embeddings", response, keep_alive=body.keep_alive) as backend:
        assert isinstance(backend, EmbedderBackend)
        result = await backend.embed(texts, truncate=body.truncate, dimensions=body.dimensions)
        report_tokens(result.total_tokens)
        mirror_to_shadow(EmbeddingReplay(texts, truncate=body.truncate), result.vectors)
    data = [
        EmbeddingData(index=i, embedding=_encode(v, body.encoding_format))
        for i, v in enumerate(result.vectors)
    ]
    usage = EmbeddingUsage(prompt_tokens=result.total_tokens, total_tokens=result.total_tokens)
    return EmbeddingPublic(data=data, model=route.name, usage=usage)


@router.post("/v1/embeddings", response_model=EmbeddingPublic)
async def create_embeddings(
    body: EmbeddingCreate, hub: HubDep, response: Response, route_key: RouteKey = None
) -> EmbeddingPublic:
    route = hub.router.route(body.model, route_key=route_key or body.user)
    return await _embed(hub, route, body, response)


@router.post("/models/{name}/embed", response_model=EmbeddingPublic)
async def embed_routed(
    name: str, body: EmbedBody, hub: HubDep, response: Response, route_key: RouteKey = None
) -> EmbeddingPublic:
    route = hub.router.route(name, route_key=route_key or body.user)
    return await _embed(hub, route, body, response)


@router.post("/models/{name}/versions/{version}/embed", response_model=EmbeddingPublic)
async def embed_version(
    name: str, version: str, body: EmbedBody, hub: HubDep, response: Response
) -> EmbeddingPublic:
    route = hub.router.route_version(name, version)
    return await _embed(hub, route, body, response)
