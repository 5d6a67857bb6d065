"""Rerank, Cohere-style: `POST /v1/rerank` and the per-model `/rerank` routes.

`{model, query, documents, top_n?, return_documents?}` -> `{id, model, results, usage}` where
`results` holds, most relevant first, `{index, relevance_score}` for the `top_n` best documents
(all of them without `top_n`), plus `document: {text}` with `return_documents`. `index` is the
document's position in the request. Documents are strings or `{"text": ...}` objects.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from hub.api.bodies import UserBody, cancelled_if_client_leaves, openapi_body, route_key_of
from hub.api.deps import router_of, serving_of
from hub.api.priority import RequestedPriority, request_level
from hub.api.serving import RERANKER, VERSION_HEADER, KeepAlive, Serving
from hub.routing import Route
from hub.traffic.replays import RerankReplay

router = APIRouter(tags=["rerank"])


def check_query(value: Any) -> Any:
    if isinstance(value, str) and not value.strip():
        raise ValueError("query must not be empty")
    return value


def check_documents(value: Any) -> Any:
    """Refuse malformed documents with a message naming the offending one."""
    if not isinstance(value, list):
        raise ValueError("documents must be a list of strings or {text} objects")
    if not value:
        raise ValueError("documents must not be an empty list")
    for i, doc in enumerate(value):
        if isinstance(doc, str):
            continue
        if isinstance(doc, dict) and isinstance(doc.get("text"), str):
            continue
        what = "an object without a string `text`" if isinstance(doc, dict) else type(doc).__name__
        raise ValueError(f'documents[{i}] is {what}; expected a string or {{"text": string}}')
    return value


class RerankDocument(BaseModel):
    """A document as an object; fields other than `text` are accepted and ignored."""

    model_config = ConfigDict(extra="allow")

    text: str


class RerankBody(BaseModel):
    """The body of the per-model routes: the Cohere request without `model`."""

    model_config = ConfigDict(extra="forbid")

    query: Annotated[str, BeforeValidator(check_query)]
    documents: Annotated[list[str | RerankDocument], BeforeValidator(check_documents)]
    top_n: Annotated[int, Field(gt=0)] | None = None
    return_documents: bool = False
    # Extensions: refuse over-long pairs instead of truncating them; Ollama's keep_alive;
    # Cohere's priority (a class name too), never above the key's (hub/api/priority.py).
    truncate: bool = True
    keep_alive: KeepAlive = None
    priority: RequestedPriority = None


class RerankCreate(RerankBody):
    model: str


class RerankResultDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: RerankResultDocument | None = None


class RerankUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class RerankPublic(BaseModel):
    id: str
    model: str
    results: list[RerankResult]
    usage: RerankUsage


def _text(document: str | RerankDocument) -> str:
    return document if isinstance(document, str) else document.text


async def _rerank(request: Request, serving: Serving, route: Route, body: RerankBody) -> Response:
    texts = [_text(d) for d in body.documents]
    async with (
        cancelled_if_client_leaves(request),
        serving.serve(route, "rerank", RERANKER, keep_alive=body.keep_alive) as req,
    ):
        level = request_level(request, body.priority)
        scored = await req.backend.rerank(body.query, texts, truncate=body.truncate, priority=level)
        req.report_reranked(len(texts), scored.total_tokens)
        req.mirror_to_shadow(RerankReplay(body.query, texts, truncate=body.truncate), scored.scores)
    # Most relevant first; equal scores keep document order, as a stable sort does.
    order = sorted(range(len(texts)), key=lambda i: -scored.scores[i])[: body.top_n]
    results = [
        RerankResult(
            index=i,
            relevance_score=scored.scores[i],
            document=RerankResultDocument(text=texts[i]) if body.return_documents else None,
        )
        for i in order
    ]
    tokens = scored.total_tokens
    public = RerankPublic(
        id=str(uuid.uuid4()),
        model=route.name,
        results=results,
        usage=RerankUsage(prompt_tokens=tokens, total_tokens=tokens),
    )
    return Response(
        public.model_dump_json(exclude_none=True),
        media_type="application/json",
        headers={VERSION_HEADER: route.label},
    )


# Bodies are read by UserBody (hub/api/bodies.py), so each route documents its own.
_RERANK_ROUTE: dict[str, Any] = {"response_model": RerankPublic,
                                 "response_model_exclude_none": True}  # fmt: skip


@router.post("/v1/rerank", **_RERANK_ROUTE,
             openapi_extra=openapi_body(RerankCreate, route_key=True))  # fmt: skip
async def create_rerank(
    request: Request,
    body: Annotated[RerankCreate, UserBody(RerankCreate)],
) -> Response:
    route = router_of(request).route(body.model, route_key=route_key_of(request))
    return await _rerank(request, serving_of(request), route, body)


@router.post("/models/{name}/rerank", **_RERANK_ROUTE,
             openapi_extra=openapi_body(RerankBody, route_key=True))  # fmt: skip
async def rerank_routed(
    name: str,
    request: Request,
    body: Annotated[RerankBody, UserBody(RerankBody)],
) -> Response:
    route = router_of(request).route(name, route_key=route_key_of(request))
    return await _rerank(request, serving_of(request), route, body)


@router.post("/models/{name}/versions/{version}/rerank", **_RERANK_ROUTE,
             openapi_extra=openapi_body(RerankBody))  # fmt: skip
async def rerank_version(
    name: str,
    version: str,
    request: Request,
    body: Annotated[RerankBody, UserBody(RerankBody)],
) -> Response:
    route = router_of(request).route_version(name, version)
    return await _rerank(request, serving_of(request), route, body)
