"""The API's pages, served with their assets (no CDN): Swagger UI at /docs, ReDoc at /redoc, and
the agents' OpenAPI document (control_plane/openapi.py). Open to everyone, like /openapi.json."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.openapi.docs import get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import HTMLResponse

from control_plane.api.deps import PUBLIC, AgentOpenApi

router = APIRouter(include_in_schema=False, dependencies=[PUBLIC])

SWAGGER = "/static/swagger-ui"
VENDOR = "/static/vendor"

REDOC_PAGE = """<!DOCTYPE html>
<html><head><title>{title} - ReDoc</title><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="icon" href="{swagger}/favicon-32x32.png"><style>body {{ margin: 0; padding: 0; }}</style>
</head><body><div id="redoc"></div>
<script src="{vendor}/redoc/redoc.standalone.js"></script>
<script>Redoc.init("/openapi.json", {{}}, document.getElementById("redoc"));</script>
</body></html>"""


@router.get("/docs", response_class=HTMLResponse)
def swagger_ui() -> HTMLResponse:
    return get_swagger_ui_html(openapi_url="/openapi.json", title="Trainyard - Swagger UI",
                               swagger_js_url=f"{SWAGGER}/swagger-ui-bundle.js",
                               swagger_css_url=f"{SWAGGER}/swagger-ui.css",
                               swagger_favicon_url=f"{SWAGGER}/favicon-32x32.png",
                               oauth2_redirect_url="/docs/oauth2-redirect")


@router.get("/docs/oauth2-redirect", response_class=HTMLResponse)
def swagger_ui_redirect() -> HTMLResponse:
    return get_swagger_ui_oauth2_redirect_html()


@router.get("/redoc", response_class=HTMLResponse)
def redoc() -> HTMLResponse:
    return HTMLResponse(REDOC_PAGE.format(title="Trainyard", swagger=SWAGGER, vendor=VENDOR))


@router.get("/openapi/agent.json")
def agent_openapi(document: AgentOpenApi) -> dict[str, Any]:
    return document
