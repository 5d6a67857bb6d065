"""`GET /`: a single-page dashboard of models, devices and the audit log.

The page is static; its script reads the admin API with the key the user pastes (kept in
the browser's session storage), so the dashboard needs no server-side session."""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

router = APIRouter(tags=["dashboard"])


@router.get("/", response_class=HTMLResponse, include_in_schema=False)
async def dashboard() -> HTMLResponse:
    page = resources.files("hub").joinpath("static/dashboard.html").read_text()
    return HTMLResponse(page)
