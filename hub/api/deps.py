"""FastAPI dependencies shared by the routers."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Header, Request

from hub.state import Hub


async def get_hub(request: Request) -> Hub:
    # async on purpose: FastAPI runs a plain `def` dependency in its thread pool, a thread
    # hop on every request for what is an attribute read.
    hub: Hub = request.app.state.hub
    return hub


HubDep = Annotated[Hub, Depends(get_hub)]


async def require_user(
    hub: HubDep,
    authorization: Annotated[str | None, Header()] = None,
    x_api_key: Annotated[str | None, Header()] = None,
) -> str:
    return await hub.auth.check(authorization, x_api_key, admin=False)


async def require_admin(
    hub: HubDep,
    authorization: Annotated[str | None, Header()] = None,
    x_api_key: Annotated[str | None, Header()] = None,
) -> str:
    return await hub.auth.check(authorization, x_api_key, admin=True)


# The authenticated admin's name, for the audit log.
AdminActor = Annotated[str, Depends(require_admin)]


RouteKey = Annotated[str | None, Header(alias="X-Hub-Route-Key")]
