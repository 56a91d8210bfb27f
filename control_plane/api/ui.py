"""/ui: the dashboard. Server-rendered pages whose live parts htmx re-fetches (fragments), behind
the same tokens and policies as the API (api/deps.py UiAllow: the session cookie holds a server-side
session's secret (services/access/ui_sessions.py), HttpOnly and SameSite=Strict; a cancel also needs the
page's CSRF token, and the login form one of its own). Read models in
services/read/dashboard.py; templates in control_plane/ui/templates."""

from __future__ import annotations

import secrets
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import quote

from fastapi import APIRouter, Form, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.templating import Jinja2Templates
from markupsafe import Markup

from control_plane import authz
from control_plane.api.deps import (
    LOGIN_COOKIE,
    PUBLIC,
    UI_COOKIE,
    SessionDep,
    SettingsDep,
    TransactionRoute,
    UiClusterRead,
    UiJobsCancel,
    UiJobsRead,
    UiNodesRead,
    authenticate_token,
    csrf_token,
)
from control_plane.authz import Principal
from control_plane.services.access import ui_sessions
from control_plane.services.read import cluster, dashboard
from control_plane.services.runs import jobs
from trainyard.protocol.display import duration, printable

router = APIRouter(prefix="/ui", tags=["ui"], route_class=TransactionRoute, include_in_schema=False)
templates = Jinja2Templates(directory=str(Path(__file__).resolve().parents[1] / "ui" / "templates"))
HTMX = "/static/vendor/htmx/htmx.min.js"
LOGIN_FORM_S = 3600
"""How long a login form stays usable."""


def _age(at: datetime | None) -> str:
    return "-" if at is None else duration((datetime.now(UTC) - at).total_seconds())


def _number(value: float | None, digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}g}"


templates.env.filters.update(duration=duration, age=_age, number=_number)
# Every value a page shows: a job's log line, error or name cannot carry terminal escapes or
# bidirectional overrides into it (our own markup, Markup, is left as it is).
templates.env.finalize = lambda v: printable(v) if isinstance(v, str) and not isinstance(v, Markup) else v


def _page(request: Request, name: str, principal: Principal | None, status_code: int = 200,
          **context: Any) -> HTMLResponse:
    token = request.cookies.get(UI_COOKIE)
    return templates.TemplateResponse(request, name, {
        "principal": principal, "htmx": HTMX, "csrf": csrf_token(token) if token else "", **context},
        status_code=status_code)


def _login_cookie(request: Request) -> str:
    """Over HTTPS the login cookie is a ``__Host-`` one: a browser takes it only from this host,
    Secure, for path /, so a sibling domain cannot plant one of its own (cookie tossing) to log
    this browser in with the attacker's form."""
    return f"__Host-{LOGIN_COOKIE}" if request.url.scheme == "https" else LOGIN_COOKIE


def _login_page(request: Request, next: str, *, error: str | None = None, status_code: int = 200) -> HTMLResponse:
    """The login form, tied to a random value in a cookie of its own (login CSRF: a page of another
    site can neither read that cookie nor, SameSite=Strict, send it, so it cannot log this browser
    in to an account of its choosing)."""
    nonce = secrets.token_urlsafe(24)  # never one the browser brought: a planted cookie is no use
    response = _page(request, "login.html", None, status_code=status_code, next=_local(next), error=error,
                     login_csrf=csrf_token(nonce))
    response.set_cookie(_login_cookie(request), nonce, max_age=LOGIN_FORM_S, path="/", httponly=True,
                        samesite="strict", secure=request.url.scheme == "https")
    return response


@router.get("/login", response_class=HTMLResponse, dependencies=[PUBLIC])
def login_form(request: Request, next: Annotated[str, Query(max_length=512)] = "/ui") -> HTMLResponse:
    return _login_page(request, next)


@router.post("/login", response_class=HTMLResponse, dependencies=[PUBLIC])
def login(request: Request, session: SessionDep, settings: SettingsDep,
          token: Annotated[str, Form(max_length=512)] = "",
          next: Annotated[str, Form(max_length=512)] = "/ui",
          csrf: Annotated[str, Form(max_length=128)] = "") -> Response:
    """Check the token and open a session (services/access/ui_sessions.py) whose secret the cookie keeps
    (HttpOnly: no script reads it; SameSite=Strict: no other site's page sends it)."""
    nonce = request.cookies.get(_login_cookie(request))
    if not nonce or not authz.same_secret(csrf, csrf_token(nonce)):
        return _login_page(request, next, status_code=422,
                           error="This login form has expired or came from another site: log in again.")
    principal = authenticate_token(token.strip(), settings, session) if token.strip() else None
    if principal is None:
        return _login_page(request, next, status_code=422, error="That token is not valid (or expired, or revoked).")
    admin = token.strip() if principal.token_id is None else None
    secret, lifetime_s = ui_sessions.open_session(session, principal, admin_token=admin)
    response = RedirectResponse(_local(next), status_code=303)
    response.set_cookie(UI_COOKIE, secret, max_age=lifetime_s, path="/", httponly=True, samesite="strict",
                        secure=request.url.scheme == "https")
    response.delete_cookie(_login_cookie(request), path="/", secure=request.url.scheme == "https")
    return response


@router.post("/logout", dependencies=[PUBLIC])
def logout(request: Request, session: SessionDep) -> Response:
    """End the session on the server, not only in this browser: a copy of the cookie is worthless
    from here on."""
    cookie = request.cookies.get(UI_COOKIE)
    if cookie:
        ui_sessions.close_session(session, cookie)
    response = RedirectResponse("/ui/login", status_code=303)
    response.delete_cookie(UI_COOKIE, path="/")
    return response


def _local(target: str) -> str:
    """Only a path of this dashboard: a login link must not send the browser elsewhere."""
    return target if target.startswith("/ui") and "//" not in target and "\\" not in target else "/ui"


@router.get("", response_class=HTMLResponse)
def jobs_page(request: Request, session: SessionDep, principal: UiJobsRead,
              ended: Annotated[bool, Query()] = False) -> HTMLResponse:
    return _page(request, "jobs.html", principal, jobs=dashboard.job_list(session, principal, ended=ended),
                 ended=ended)


@router.get("/fragments/jobs", response_class=HTMLResponse)
def jobs_fragment(request: Request, session: SessionDep, principal: UiJobsRead,
                  ended: Annotated[bool, Query()] = False) -> HTMLResponse:
    return _page(request, "_jobs_table.html", principal, jobs=dashboard.job_list(session, principal, ended=ended),
                 ended=ended)


@router.get("/jobs/{job_id}", response_class=HTMLResponse)
def job_page(request: Request, job_id: uuid.UUID, session: SessionDep, principal: UiJobsRead,
             settings: SettingsDep) -> HTMLResponse:
    page = dashboard.job_page(session, principal, job_id, settings.recovery_budgets)
    return _page(request, "job.html", principal, page=page, chart=Markup(page.chart))  # noqa: S704 - our own SVG


@router.get("/jobs/{job_id}/live", response_class=HTMLResponse)
def job_live(request: Request, job_id: uuid.UUID, session: SessionDep, principal: UiJobsRead,
             settings: SettingsDep) -> HTMLResponse:
    page = dashboard.job_page(session, principal, job_id, settings.recovery_budgets)
    return _page(request, "_job_live.html", principal, page=page, chart=Markup(page.chart))  # noqa: S704


@router.get("/jobs/{job_id}/logs", response_class=HTMLResponse)
def job_logs(request: Request, job_id: uuid.UUID, session: SessionDep, principal: UiJobsRead,
             after: Annotated[int, Query(ge=0, le=2**63 - 1)] = 0) -> HTMLResponse:
    tail = dashboard.log_tail(session, principal, job_id, after=after)
    return _page(request, "_log_lines.html", principal, tail=tail, job_id=job_id, first=after == 0)


@router.post("/jobs/{job_id}/cancel", response_class=HTMLResponse)
def cancel(request: Request, job_id: uuid.UUID, session: SessionDep, principal: UiJobsCancel) -> Response:
    jobs.cancel(session, job_id, principal)
    if request.headers.get("HX-Request"):  # htmx: let the page load itself again
        return Response(status_code=200, headers={"HX-Redirect": f"/ui/jobs/{job_id}"})
    return RedirectResponse(f"/ui/jobs/{job_id}", status_code=303)


@router.get("/nodes", response_class=HTMLResponse)
def nodes_page(request: Request, session: SessionDep, principal: UiNodesRead) -> HTMLResponse:
    return _page(request, "nodes.html", principal, rows=dashboard.node_grid(session))


@router.get("/cluster", response_class=HTMLResponse)
def cluster_page(request: Request, session: SessionDep, principal: UiClusterRead) -> HTMLResponse:
    return _page(request, "cluster.html", principal, summary=cluster.summary(session, tenant=principal.tenant_filter))


def error_page(request: Request, status: int, detail: str) -> Response:
    """A refusal shown to a browser: the login page for 401, a page saying why otherwise."""
    if status == 401:
        return RedirectResponse(f"/ui/login?next={quote(request.url.path)}", status_code=303)
    return _page(request, "error.html", None, status_code=status, status=status, detail=detail)
