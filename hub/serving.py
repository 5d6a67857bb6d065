"""The request path shared by every inference route: check the kind, acquire, measure.

Routes reach it as `ServingDep` (hub.api.deps); the HTTP parts (bodies, the version header
on answers) stay in hub.api.

    async with serving.serve(route, "embeddings", EMBEDDER, keep_alive=...) as req:
        result = await req.backend.embed(...)      # req.backend is an EmbedderBackend
        req.report_tokens(result.total_tokens)
        req.mirror_to_shadow(EmbeddingReplay(...), result.vectors)

`serve` refuses a model of another kind (400) before anything is acquired, checks the
backend's class once (routes need no `isinstance`), and on the way out counts the request in
`hub_requests_total` with the status `status_of` (hub.outcome) gives its exception: the
status the error answer carries too.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from backends.base import Backend
from backends.encoders.embedder import EmbedderBackend
from backends.encoders.reranker import RerankerBackend
from backends.errors import BackendError, CapacityError
from backends.llm.backend import LLMBackend
from hub.errors import BadRequest, HubError
from hub.manager import ModelManager
from hub.metrics import HubMetrics
from hub.outcome import CLIENT_CLOSED, status_of
from hub.routing import Route
from hub.saturation import Saturation
from hub.traffic.request import ServedRequest
from hub.traffic.service import TrafficService
from hub.traffic.shadow import Replay
from hub.usage.caller import current_caller
from hub.usage.meter import UsageMeter
from registry.usage import UsageCounts

VERSION_HEADER = "X-Hub-Model-Version"

B = TypeVar("B", bound=Backend)


@dataclass(frozen=True)
class Kind(Generic[B]):
    """A model kind as a route asks for it: the registry's name and the backend class."""

    name: str
    backend: type[B]


EMBEDDER = Kind("embedder", EmbedderBackend)
RERANKER = Kind("reranker", RerankerBackend)
LLM = Kind("llm", LLMBackend)

# How a refusal names a kind and what an endpoint needs, as a sentence reads them.
_A_KIND = {"llm": "an LLM", "embedder": "an embedder", "reranker": "a reranker"}
_ENDPOINT_NEEDS = {
    "embeddings": "embeddings need",
    "rerank": "reranking needs",
    "chat": "chat completions need",
    "completions": "completions need",
    "generate": "generation needs",
    "responses": "responses need",
}


def wrong_kind_message(name: str, kind: str, endpoint: str, wanted: str) -> str:
    """The refusal of `name` (a `kind`) at `endpoint`, which needs a `wanted`, e.g.
    "model 'x' is an LLM; embeddings need an embedder"."""
    needs = _ENDPOINT_NEEDS.get(endpoint, f"the {endpoint} endpoint needs")
    return f"model {name!r} is {_A_KIND.get(kind, kind)}; {needs} {_A_KIND.get(wanted, wanted)}"


@dataclass
class InferenceRequest(Generic[B]):
    """One request inside `serve()`: the routed version, its backend (of the kind the route
    asked for), the traffic layer's record, which takes tokens and shadow material, and the
    usage it is metered for (LLM tokens are reported by hub.api.generation)."""

    route: Route
    backend: B
    served: ServedRequest
    usage: UsageCounts

    def report_tokens(self, tokens: int) -> None:
        """Input tokens (embeddings, rerank) or generated tokens (LLM), for readouts."""
        self.served.report_tokens(tokens)

    def report_embedded(self, inputs: int, tokens: int) -> None:
        """An embedder's `inputs` and their `tokens`, for readouts and metering."""
        self.served.report_tokens(tokens)
        self.usage.embedded_inputs += inputs
        self.usage.embedded_tokens += tokens
        self.usage.prompt_tokens += tokens

    def report_reranked(self, documents: int, tokens: int) -> None:
        """A reranker's `documents` and the tokens of their pairs with the query, for readouts
        and metering."""
        self.served.report_tokens(tokens)
        self.usage.rerank_documents += documents
        self.usage.prompt_tokens += tokens

    def mirror_to_shadow(self, replay: Replay, output: Any) -> None:
        """The primary's `output` and how to replay the request on the shadow version; kept
        only when the traffic policy selected this request for its shadow."""
        self.served.mirror_to_shadow(replay, output)


class Serving:
    """The parts every inference request passes through: the manager (acquire), the traffic
    layer (faults, samples, shadow) and the request metrics.

    Contract: `serve` acquires the routed version for one request and yields an
    `InferenceRequest` typed by `kind`; every request it starts is counted once in
    `hub_requests_total` with `status_of(exception)` (200 without one, 499 when cancelled),
    handed to the traffic layer's `finish`, and metered by `usage` (when metering is on)
    under the caller the request's user-key check named: its exit waits for that usage to be
    committed (bounded by the meter), so an answer written after it never outruns its usage.
    """

    def __init__(
        self,
        manager: ModelManager,
        traffic: TrafficService,
        metrics: HubMetrics,
        saturation: Saturation | None = None,
        usage: UsageMeter | None = None,
    ) -> None:
        self.manager = manager
        self.traffic = traffic
        self.metrics = metrics
        self.saturation = saturation
        self.usage = usage

    @contextlib.asynccontextmanager
    async def serve(
        self,
        route: Route,
        endpoint: str,
        kind: Kind[B],
        *,
        keep_alive: float | None = None,
    ) -> AsyncIterator[InferenceRequest[B]]:
        """Serve one request with `route`'s version; faults the traffic policy injects are
        raised here, before the model is acquired."""
        if route.kind != kind.name:
            raise BadRequest(
                wrong_kind_message(route.name, route.kind, endpoint, kind.name),
                param="model",
                code="wrong_model_kind",
            )
        labels = (route.name, str(route.version), endpoint)
        served = self.traffic.begin(route)
        usage = UsageCounts(requests=1)
        caller = current_caller()
        start = self.traffic.timer.now()
        status = 200
        try:
            await self.traffic.inject_faults(route)
            async with self.manager.acquire(
                route.name, route.version, route.kind, keep_alive=keep_alive
            ) as backend:
                if not isinstance(backend, kind.backend):
                    raise TypeError(
                        f"{route.name} v{route.version} is registered as a {kind.name} but its "
                        f"backend is a {type(backend).__name__}, not a {kind.backend.__name__}"
                    )
                yield InferenceRequest(route, backend, served, usage)
        except BaseException as e:
            status = status_of(e).status
            # The error answer (an injected fault, a load failure) names the version too.
            if isinstance(e, HubError):
                e.headers.setdefault(VERSION_HEADER, route.label)
            elif isinstance(e, BackendError):
                e.served_by = route.label
            # A bare name's fixed route whose queue is over its bound for a while yet: the
            # edge refuses the next requests for it at once until then.
            fixed = not (route.pinned or route.split or route.via)
            if isinstance(e, CapacityError) and fixed and self.saturation is not None:
                self.saturation.mark(route.name, route.version, route.kind, e)
            raise
        finally:
            elapsed = self.traffic.timer.now() - start
            self.metrics.requests.labels(*labels, str(status)).inc()
            self.metrics.request_seconds.labels(*labels).observe(elapsed)
            # A client that went away says nothing about the model: not recorded as a sample.
            outcome = None if status == CLIENT_CLOSED else status
            self.traffic.finish(served, latency_s=elapsed, status=outcome)
            if self.usage is not None:
                usage.errors = int(status >= 400)
                # A client that left reads no answer: nothing waits for its commit.
                await self.usage.record(caller, route.name, route.version, usage,
                                        wait=status != CLIENT_CLOSED)  # fmt: skip
