"""Embeddings: OpenAI's `POST /v1/embeddings` and the per-model `/embed` routes.

`input` is a string, a list of strings, one list of token ids or a list of token-id lists
(content ids, as `tokenizer.encode(text, add_special_tokens=False)` gives them; the model's
special tokens are added). The response is OpenAI's; its JSON is written directly from the
vectors rather than through a response model, which would validate every float of every vector.
"""

from __future__ import annotations

import base64
import json
from typing import Annotated, Any, Literal

import numpy as np
from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from backends.encoders.embedder import Embeddings
from hub.api.bodies import UserBody, cancelled_if_client_leaves, openapi_body, route_key_of
from hub.api.deps import router_of, serving_of
from hub.api.priority import RequestedPriority, request_level
from hub.api.serving import EMBEDDER, VERSION_HEADER, KeepAlive, Serving
from hub.routing import Route
from hub.traffic.replays import EmbeddingReplay

router = APIRouter(tags=["embeddings"])

_SHAPES = "a string, a list of strings, a list of token ids or a list of token-id lists"


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_input(value: Any) -> Any:
    """Refuse a malformed `input` with a message naming the offending item."""
    if isinstance(value, str):
        if not value:
            raise ValueError("input must not be an empty string")
        return value
    if not isinstance(value, list):
        raise ValueError(f"input must be {_SHAPES}, not {_kind(value)}")
    if not value:
        raise ValueError("input must not be an empty list")
    first = value[0]
    if isinstance(first, str):
        for i, item in enumerate(value):
            if not isinstance(item, str):
                raise ValueError(f"input[{i}] is {_kind(item)}; every item must be a string")
            if not item:
                raise ValueError(f"input[{i}] is an empty string")
    elif _is_id(first):
        for i, item in enumerate(value):
            if not _is_id(item):
                raise ValueError(f"input[{i}] is {_kind(item)}; token ids must be integers")
    elif isinstance(first, list):
        for i, item in enumerate(value):
            if not isinstance(item, list) or not item:
                what = "an empty list" if isinstance(item, list) else _kind(item)
                raise ValueError(f"input[{i}] is {what}; expected a non-empty token-id list")
            bad = next((t for t in item if not _is_id(t)), None)
            if bad is not None:
                raise ValueError(f"input[{i}] holds {_kind(bad)}; token ids must be integers")
    else:
        raise ValueError(f"input[0] is {_kind(first)}; input must be {_SHAPES}")
    return value


EmbeddingInput = Annotated[
    str | list[str] | list[int] | list[list[int]], BeforeValidator(_check_input)
]


class EmbedBody(BaseModel):
    """The body of the per-model routes: the OpenAI request without `model`."""

    model_config = ConfigDict(extra="forbid")

    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(gt=0)] | None = None
    user: str | None = None
    # Extensions: refuse over-long inputs instead of truncating them; Ollama's keep_alive;
    # a priority class or level, never above the key's (hub/api/priority.py).
    truncate: bool = True
    keep_alive: KeepAlive = None
    priority: RequestedPriority = None


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
    """The response (documented; written by `_response_bytes`)."""

    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


def _inputs(value: str | list[str] | list[int] | list[list[int]]) -> list[Any]:
    """One entry per input: a string or a list of token ids."""
    if isinstance(value, str):
        return [value]
    if _is_id(value[0]):
        return [value]
    return value


def _response_bytes(result: Embeddings, model: str, encoding_format: str) -> bytes:
    """OpenAI's embeddings response as JSON, written directly from the float32 vectors."""
    vectors = np.asarray(result.vectors, dtype="<f4")
    if encoding_format == "base64":
        encoded = ['"' + base64.b64encode(v.tobytes()).decode() + '"' for v in vectors]
    else:
        # float32 -> float64 is exact, and repr of a float is valid JSON for finite values.
        encoded = [json.dumps(v.tolist()) for v in vectors]
    data = ",".join(
        f'{{"object":"embedding","index":{i},"embedding":{e}}}' for i, e in enumerate(encoded)
    )
    tokens = result.total_tokens
    return (
        f'{{"object":"list","data":[{data}],"model":{json.dumps(model)},'
        f'"usage":{{"prompt_tokens":{tokens},"total_tokens":{tokens}}}}}'
    ).encode()


async def _embed(request: Request, serving: Serving, route: Route, body: EmbedBody) -> Response:
    async with (
        cancelled_if_client_leaves(request),
        serving.serve(route, "embeddings", EMBEDDER, keep_alive=body.keep_alive) as req,
    ):
        inputs = _inputs(body.input)
        result = await req.backend.embed(
            inputs,
            truncate=body.truncate,
            dimensions=body.dimensions,
            priority=request_level(request, body.priority),
        )
        req.report_embedded(len(inputs), result.total_tokens)
        req.mirror_to_shadow(EmbeddingReplay(inputs, truncate=body.truncate), result.vectors)
    return Response(
        _response_bytes(result, route.name, body.encoding_format),
        media_type="application/json",
        headers={VERSION_HEADER: route.label},
    )


# Bodies are read by UserBody (hub/api/bodies.py), so each route documents its own.
_ROUTED = openapi_body(EmbedBody, route_key=True)
_VERSION = openapi_body(EmbedBody)


@router.post("/v1/embeddings", response_model=EmbeddingPublic,
             openapi_extra=openapi_body(EmbeddingCreate, route_key=True))  # fmt: skip
async def create_embeddings(
    request: Request,
    body: Annotated[EmbeddingCreate, UserBody(EmbeddingCreate)],
) -> Response:
    route = router_of(request).route(body.model, route_key=route_key_of(request) or body.user)
    return await _embed(request, serving_of(request), route, body)


@router.post("/models/{name}/embed", response_model=EmbeddingPublic, openapi_extra=_ROUTED)
async def embed_routed(
    name: str,
    request: Request,
    body: Annotated[EmbedBody, UserBody(EmbedBody)],
) -> Response:
    route = router_of(request).route(name, route_key=route_key_of(request) or body.user)
    return await _embed(request, serving_of(request), route, body)


@router.post(
    "/models/{name}/versions/{version}/embed",
    response_model=EmbeddingPublic,
    openapi_extra=_VERSION,
)
async def embed_version(
    name: str,
    version: str,
    request: Request,
    body: Annotated[EmbedBody, UserBody(EmbedBody)],
) -> Response:
    route = router_of(request).route_version(name, version)
    return await _embed(request, serving_of(request), route, body)
