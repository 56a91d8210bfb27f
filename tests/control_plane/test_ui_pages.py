"""The dashboard's pages without a browser (issue 13): log in with a token (an HttpOnly,
SameSite=Strict cookie), every page renders for the roles its policy allows, tenant scoping as in
the API, a cancel needs the page's CSRF token, and a browser without a session is sent to the login."""

from __future__ import annotations

import re
from datetime import UTC, datetime

from control_plane.api.deps import LOGIN_COOKIE, UI_COOKIE, csrf_token
from tests.control_plane.access import make_principal
from tests.control_plane.helpers import submit
from tests.factories import ADMIN_TOKEN, FakeAgentSession, workers_for

HTML = {"Accept": "text/html"}


def login_csrf(client) -> str:
    """Open the login form as a browser does: its hidden csrf field (tied to the form's cookie)."""
    form = client.get("/ui/login")
    assert form.status_code == 200 and LOGIN_COOKIE in form.headers["set-cookie"]
    found = re.search(r'name="csrf" value="([^"]+)"', form.text)
    assert found, form.text
    return found.group(1)


def _login(client, token: str) -> str:
    """Log in through the form; the session cookie's value."""
    r = client.post("/ui/login", data={"token": token, "next": "/ui/nodes", "csrf": login_csrf(client)},
                    follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/ui/nodes", r.text
    cookie = r.headers["set-cookie"]
    assert f"{UI_COOKIE}=" in cookie and "HttpOnly" in cookie and "SameSite=strict" in cookie
    value = client.cookies[UI_COOKIE]
    assert token not in cookie and value.startswith("tys_")  # a session's own secret, never the API token
    return value


def test_pages_render_for_a_logged_in_admin_and_a_cancel_needs_the_csrf_token(client, schedule):
    agent = FakeAgentSession(client, "node-1", 2)
    job = submit(client, num_nodes=1, name="watched")
    schedule()
    (spec,) = agent.heartbeat()["assignments"]
    agent.status(spec, "running", workers=workers_for(spec, "running"), progress={
        "step": 7, "loss": 1.25, "at": datetime.now(UTC).isoformat(), "total_steps": 70, "metrics": {"lr": 0.01}})
    client.post(f"/v1/agent/attempts/{spec['attempt_id']}/logs", headers=agent.headers, json={
        "fencing_token": spec["fencing_token"], "node_rank": 0,
        "chunks": [{"rank": 0, "stream": "stdout", "offset": 0, "data": "hello <from> rank 0\n"}]})

    assert client.get("/ui", headers=HTML, follow_redirects=False).headers["location"] == "/ui/login?next=/ui"
    bad = client.post("/ui/login", data={"token": "tyt_nope", "csrf": login_csrf(client)})
    assert bad.status_code == 422 and "not valid" in bad.text
    session = _login(client, ADMIN_TOKEN)
    jobs = client.get("/ui")
    assert jobs.status_code == 200 and "watched" in jobs.text and "7/70" in jobs.text and htmx_src(jobs.text)
    page = client.get(f"/ui/jobs/{job['id']}")
    assert page.status_code == 200 and "<svg" in page.text and "node-1" in page.text and "#1" in page.text
    logs = client.get(f"/ui/jobs/{job['id']}/logs")
    assert "hello &lt;from&gt; rank 0" in logs.text  # escaped
    assert "node-1" in client.get("/ui/nodes").text and "watched" in client.get("/ui/nodes").text
    assert "utilization" in client.get("/ui/cluster").text

    refused = client.post(f"/ui/jobs/{job['id']}/cancel", headers={"HX-Request": "true"})
    assert refused.status_code == 403 and "CSRF" in refused.json()["detail"]
    done = client.post(f"/ui/jobs/{job['id']}/cancel",
                       headers={"HX-Request": "true", "X-CSRF-Token": csrf_token(session)})
    assert done.status_code == 200 and done.headers["HX-Redirect"] == f"/ui/jobs/{job['id']}"
    assert client.get(f"/v1/jobs/{job['id']}", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}).json()[
        "state"] == "cancelling"


def htmx_src(text: str) -> bool:
    return 'src="/static/vendor/htmx/htmx.min.js"' in text


def test_tenants_see_their_own_jobs_and_members_no_nodes(client):
    FakeAgentSession(client, "node-1", 2)
    theirs = submit(client, num_nodes=1, name="theirs", tenant="nlp")
    alice = make_principal(client, "alice", "member", "vision")
    mine = client.post("/v1/jobs", json={**_body(), "name": "mine"}, headers=alice.headers).json()
    _login(client, alice.token)
    listing = client.get("/ui").text
    assert "mine" in listing and "theirs" not in listing
    other = client.get(f"/ui/jobs/{theirs['id']}", headers=HTML)
    assert other.status_code == 404 and "does not exist" in other.text
    assert client.get(f"/ui/jobs/{mine['id']}").status_code == 200
    nodes = client.get("/ui/nodes", headers=HTML)
    assert nodes.status_code == 403 and "may not" in nodes.text


def _body() -> dict:
    from tests.factories import job_body

    return job_body(num_nodes=1)


def test_a_login_form_from_another_site_is_refused(client):
    """Login CSRF: a page of another site cannot post the login form with its own token and log this
    browser in to the attacker's account: without the form's cookie (SameSite=Strict keeps it off a
    cross-site post) or with another form's value, the login is refused and no session is opened."""
    forged = client.post("/ui/login", data={"token": ADMIN_TOKEN, "next": "/ui"}, follow_redirects=False)
    assert forged.status_code == 422 and "another site" in forged.text and UI_COOKIE not in client.cookies
    login_csrf(client)  # this browser has a form of its own, but the attacker cannot know its value
    other = client.post("/ui/login", data={"token": ADMIN_TOKEN, "csrf": "0" * 32}, follow_redirects=False)
    assert other.status_code == 422 and UI_COOKIE not in client.cookies
    # Over HTTPS the form's cookie is a __Host- one, which no sibling domain can plant (cookie tossing).
    form = client.get("https://testserver/ui/login")
    cookie = form.headers["set-cookie"]
    assert cookie.startswith(f"__Host-{LOGIN_COOKIE}=") and "Secure" in cookie and "Path=/;" in cookie, cookie
    assert "Domain" not in cookie


def test_logout_ends_the_session_on_the_server_and_a_revoked_token_ends_its_sessions(client):
    alice = make_principal(client, "alice", "member", "vision")
    session = _login(client, alice.token)
    assert client.get("/ui").status_code == 200
    client.post("/ui/logout", follow_redirects=False)
    # A copy of the cookie (a stolen one, another tab) is worthless once logged out.
    client.cookies.clear()
    client.cookies.set(UI_COOKIE, session)
    assert client.get("/ui", headers=HTML, follow_redirects=False).status_code == 303

    client.cookies.clear()
    session = _login(client, alice.token)
    assert client.get("/ui").status_code == 200
    tokens = client.get("/v1/tokens", headers=alice.headers).json()
    (token_id,) = [t["id"] for t in (tokens["items"] if isinstance(tokens, dict) else tokens)]
    assert client.delete(f"/v1/tokens/{token_id}", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}).status_code \
        in (200, 204)
    assert client.get("/ui", headers=HTML, follow_redirects=False).headers["location"].startswith("/ui/login")


def test_log_lines_and_errors_reach_the_page_with_control_characters_written_out(client, schedule):
    agent = FakeAgentSession(client, "node-1", 2)
    job = submit(client, num_nodes=1, name="escapes")
    schedule()
    (spec,) = agent.heartbeat()["assignments"]
    agent.status(spec, "running", workers=workers_for(spec, "running"))
    client.post(f"/v1/agent/attempts/{spec['attempt_id']}/logs", headers=agent.headers, json={
        "fencing_token": spec["fencing_token"], "node_rank": 0,
        "chunks": [{"rank": 0, "stream": "stdout", "offset": 0,
                    "data": "\x1b]0;pwned\x07\x1b[2Jcleared \u202etxt.exe\n"}]})
    _login(client, ADMIN_TOKEN)
    text = client.get(f"/ui/jobs/{job['id']}/logs").text
    assert "\x1b" not in text and "\u202e" not in text and "\x07" not in text
    assert "\\x1b]0;pwned\\x07\\x1b[2Jcleared \\u202etxt.exe" in text
