"""The request path shared by every inference route: route, check kind, acquire, measure."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import Response
from pydantic import BeforeValidator

from backends.base import Backend
from backends.errors import BackendClosedError, CapacityError, InputError
from hub.errors import BadRequest, HubError
from hub.routing import Route
from hub.state import Hub
from hub.units import parse_duration

VERSION_HEADER = "X-Hub-Model-Version"


def require_kind(route: Route, kind: str, endpoint: str) -> None:
    if route.kind != kind:
        raise BadRequest(
            f"model {route.name!r} is a {route.kind}; {endpoint} needs a {kind}",
            param="model",
            code="wrong_model_kind",
        )


def _keep_alive(value: Any) -> float | None:
    return None if value is None else parse_duration(value)


# Ollama's keep_alive on a request: a duration ("5m", 30), -1 to keep forever, 0 to unload
# right after the request.
KeepAlive = Annotated[float | None, BeforeValidator(_keep_alive)]


@contextlib.asynccontextmanager
async def serve(
    hub: Hub,
    route: Route,
    endpoint: str,
    response: Response | None = None,
    *,
    keep_alive: float | None = None,
) -> AsyncIterator[Backend]:
    """Acquire the routed version's backend for one request and record its outcome: metrics,
    and a per-version sample for readouts and canaries (hub.traffic). Inside the block a
    route may call `hub.traffic.request.report_tokens` and `mirror_to_shadow`; faults the
    traffic policy injects are raised here, before the model is acquired."""
    if response is not None:
        response.headers[VERSION_HEADER] = route.label
    labels = (route.name, str(route.version), endpoint)
    served = hub.traffic.begin(route)
    start = time.perf_counter()
    status = "200"
    try:
        await hub.traffic.inject_faults(route)
        async with hub.manager.acquire(
            route.name, route.version, route.kind, keep_alive=keep_alive
        ) as backend:
            yield backend
    except HubError as e:
        status = str(e.status_code)
        # The error answer (an injected fault, a load failure) names the version too.
        e.headers.setdefault(VERSION_HEADER, route.label)
        raise
    except InputError as e:
        status = "400"
        e.served_by = route.label
        raise
    except (CapacityError, BackendClosedError) as e:
        status = "503"
        e.served_by = route.label
        raise
    except asyncio.CancelledError:
        status = "cancelled"
        raise
    except BaseException:
        status = "500"
        raise
    finally:
        elapsed = time.perf_counter() - start
        # A cancelled request's client went away: nginx's 499, "client closed request".
        hub.metrics.requests.labels(*labels, "499" if status == "cancelled" else status).inc()
        hub.metrics.request_seconds.labels(*labels).observe(elapsed)
        outcome = None if status == "cancelled" else int(status)
        hub.traffic.finish(served, latency_s=elapsed, status=outcome)
