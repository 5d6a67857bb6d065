"""Rerank in the other shapes clients speak, beside Cohere v1 / Jina's `POST /v1/rerank`.

- `POST /v2/rerank`, Cohere v2 (`cohere.ClientV2.rerank`, litellm's `cohere/` provider):
  `{model, query, documents, top_n?, max_tokens_per_doc?, return_documents?, priority?}` ->
  `{id, results: [{index, relevance_score, document?: {text}}], meta: {api_version,
  billed_units, tokens}}`. `max_tokens_per_doc` cuts each document to its first that many
  tokens before it is paired with the query; `priority` (Cohere's level, lower first, or a
  class name) orders the reranker's batches, never above the key's class (hub/api/priority.py).
- `POST /rerank`, Hugging Face TEI when the body has `texts`: `{query, texts, model?,
  return_text?, truncate?, raw_scores?, truncation_direction?, top_n?}` -> `[{index, score,
  text?}]`, most relevant first (the first `top_n` of them; litellm's `huggingface/` provider
  sends it). TEI serves one model, so `model` may be left out when exactly one reranker is
  registered. Without `texts` the body is Jina's / Cohere v1's, answered exactly
  as `/v1/rerank` answers it (vLLM serves that shape on `/rerank` too).

Scores, truncation, routing by name or `name@alias`, and errors are those of `/v1/rerank`.
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from backends.encoders.reranker import Scores
from hub.api.bodies import (
    UserBody,
    cancelled_if_client_leaves,
    openapi_body,
    read_user_body,
    request_body,
    route_key_of,
)
from hub.api.deps import hub_of, router_of, serving_of
from hub.api.priority import RequestedPriority, request_level
from hub.api.rerank import (
    RerankCreate,
    RerankDocument,
    RerankResult,
    RerankResultDocument,
    check_documents,
    check_query,
    create_rerank,
)
from hub.api.serving import RERANKER, VERSION_HEADER, KeepAlive, Serving
from hub.catalog import Catalog
from hub.errors import BadRequest
from hub.routing import Route
from hub.traffic.replays import RerankReplay
from registry.bounded_json import loads_bounded

router = APIRouter(tags=["rerank"])

Query = Annotated[str, BeforeValidator(check_query)]
PositiveInt = Annotated[int, Field(gt=0)]
# Cohere bills one search unit per query with up to 100 documents.
DOCUMENTS_PER_SEARCH_UNIT = 100


async def score(
    request: Request,
    serving: Serving,
    route: Route,
    query: str,
    texts: Sequence[str],
    *,
    truncate: bool,
    max_tokens_per_doc: int | None = None,
    keep_alive: float | None = None,
    priority: int | str | None = None,
) -> Scores:
    """Score `texts` against `query` on the routed reranker, recorded as `/v1/rerank` is;
    `priority` as the request asked it (`hub.api.priority`)."""
    async with (
        cancelled_if_client_leaves(request),
        serving.serve(route, "rerank", RERANKER, keep_alive=keep_alive) as req,
    ):
        scored = await req.backend.rerank(
            query,
            texts,
            truncate=truncate,
            max_tokens_per_doc=max_tokens_per_doc,
            priority=request_level(request, priority),
        )
        req.report_reranked(len(texts), scored.total_tokens)
        replay = RerankReplay(query, texts, truncate, max_tokens_per_doc)
        req.mirror_to_shadow(replay, scored.scores)
    return scored


def ranked(scores: Sequence[float], top_n: int | None = None) -> list[int]:
    """Document indices, most relevant first; equal scores keep document order."""
    return sorted(range(len(scores)), key=lambda i: -scores[i])[:top_n]


def _json(body: BaseModel | list[Any], route: Route) -> Response:
    content = (
        body.model_dump_json(exclude_none=True)
        if isinstance(body, BaseModel)
        else json.dumps(body, ensure_ascii=False)
    )
    return Response(content, media_type="application/json", headers={VERSION_HEADER: route.label})


# ---- Cohere v2 -------------------------------------------------------------------------------
class CohereRerankCreate(BaseModel):
    """Cohere v2's rerank request; documents may also be `{text}` objects, as litellm and
    older Cohere clients send them."""

    model_config = ConfigDict(extra="forbid")

    model: str
    query: Query
    documents: Annotated[list[str | RerankDocument], BeforeValidator(check_documents)]
    top_n: PositiveInt | None = None
    max_tokens_per_doc: PositiveInt | None = None
    return_documents: bool = False
    priority: RequestedPriority = None
    # Extensions, as on /v1/rerank: refuse over-long pairs instead of truncating them;
    # Ollama's keep_alive.
    truncate: bool = True
    keep_alive: KeepAlive = None


class CohereApiVersion(BaseModel):
    version: str


class CohereBilledUnits(BaseModel):
    search_units: int


class CohereTokens(BaseModel):
    input_tokens: int


class CohereMeta(BaseModel):
    api_version: CohereApiVersion
    billed_units: CohereBilledUnits
    tokens: CohereTokens


class CohereRerankPublic(BaseModel):
    id: str
    results: list[RerankResult]
    meta: CohereMeta


@router.post("/v2/rerank", response_model=CohereRerankPublic, response_model_exclude_none=True,
             openapi_extra=openapi_body(CohereRerankCreate))  # fmt: skip
async def create_rerank_v2(
    request: Request,
    body: Annotated[CohereRerankCreate, UserBody(CohereRerankCreate)],
) -> Response:
    route = router_of(request).route(body.model, route_key=route_key_of(request))
    serving = serving_of(request)
    texts = [d if isinstance(d, str) else d.text for d in body.documents]
    scored = await score(request, serving, route, body.query, texts, truncate=body.truncate,
                         max_tokens_per_doc=body.max_tokens_per_doc,
                         keep_alive=body.keep_alive, priority=body.priority)  # fmt: skip
    results = [
        RerankResult(
            index=i,
            relevance_score=scored.scores[i],
            document=RerankResultDocument(text=texts[i]) if body.return_documents else None,
        )
        for i in ranked(scored.scores, body.top_n)
    ]
    meta = CohereMeta(
        api_version=CohereApiVersion(version="2"),
        billed_units=CohereBilledUnits(
            search_units=math.ceil(len(texts) / DOCUMENTS_PER_SEARCH_UNIT)
        ),
        tokens=CohereTokens(input_tokens=scored.total_tokens),
    )
    return _json(CohereRerankPublic(id=str(uuid.uuid4()), results=results, meta=meta), route)


# ---- TEI -------------------------------------------------------------------------------------
class TeiRerankCreate(BaseModel):
    """Hugging Face text-embeddings-inference's rerank request, plus an optional `model`."""

    model_config = ConfigDict(extra="forbid")

    query: Query
    texts: Annotated[list[str], Field(min_length=1)]
    model: str | None = None
    return_text: bool = False
    # TEI refuses over-long pairs unless asked to truncate; so does the hub here.
    truncate: bool = False
    truncation_direction: Literal["Right", "Left", "right", "left"] = "Right"
    raw_scores: bool = False
    # Not TEI's own: litellm's `huggingface/` rerank sends it; the most relevant top_n only.
    top_n: PositiveInt | None = None
    keep_alive: KeepAlive = None


class TeiRank(BaseModel):
    index: int
    score: float
    text: str | None = None


def _only_reranker(catalog: Catalog) -> str:
    snapshot = catalog.snapshot
    names = [n for n in snapshot.names()
             if snapshot.models[n].kind == "reranker" and snapshot.models[n].versions]  # fmt: skip
    if len(names) != 1:
        known = ", ".join(names) or "none registered"
        raise BadRequest(
            f"name the reranker in `model`: without it /rerank needs exactly one registered "
            f"reranker (rerankers: {known})",
            param="model",
        )
    return names[0]


async def _tei_rerank(request: Request) -> Response:
    body = await read_user_body(request, TeiRerankCreate)
    if body.raw_scores:
        raise BadRequest(
            "raw_scores is not supported: scores are the model's own activation of its logit "
            "(sigmoid for a one-label cross-encoder), as CrossEncoder.predict gives them",
            param="raw_scores",
        )
    if body.truncation_direction.lower() == "left":
        raise BadRequest(
            "truncation_direction Left is not supported; over-long pairs are truncated "
            "longest first, as the model's tokenizer does",
            param="truncation_direction",
        )
    model = body.model or _only_reranker(hub_of(request).catalog)
    route = router_of(request).route(model, route_key=route_key_of(request))
    scored = await score(request, serving_of(request), route, body.query, body.texts,
                         truncate=body.truncate, keep_alive=body.keep_alive)  # fmt: skip
    ranks = [
        TeiRank(index=i, score=scored.scores[i], text=body.texts[i] if body.return_text else None)
        for i in ranked(scored.scores, body.top_n)
    ]
    return _json([r.model_dump(exclude_none=True) for r in ranks], route)


def _either(*bodies: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` documenting a request body that is one of `bodies`."""
    schemas = [
        openapi_body(b)["requestBody"]["content"]["application/json"]["schema"] for b in bodies
    ]
    content = {"application/json": {"schema": {"oneOf": schemas}}}
    return {"requestBody": {"required": True, "content": content}}


@router.post("/rerank", openapi_extra=_either(TeiRerankCreate, RerankCreate))
async def rerank_tei_or_jina(request: Request) -> Response:
    """TEI's request (it has `texts`) answered in TEI's shape; any other body is Jina's /
    Cohere v1's, answered as `/v1/rerank` answers it."""
    try:
        peek = loads_bounded(await request_body(request))
    except ValueError:  # not JSON or nested too deep: the user-key check comes first, then
        peek = None  # the body's own parse answers the 400
    if isinstance(peek, dict) and "texts" in peek:
        return await _tei_rerank(request)
    body = await read_user_body(request, RerankCreate)
    return await create_rerank(request, body)
