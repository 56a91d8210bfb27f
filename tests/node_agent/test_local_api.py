"""The local API for workers, over real HTTP."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from node_agent.local_api import LocalApi


@pytest.fixture
def api() -> Iterator[LocalApi]:
    api = LocalApi("127.0.0.2", 0)
    api.start()
    api.reports.register("att-1", "fence-1")
    try:
        yield api
    finally:
        api.stop()
        api.stop()  # idempotent


def post(api: LocalApi, attempt_id: str, kind: str, body: dict[str, object]) -> httpx.Response:
    return httpx.post(f"{api.url}/v1/local/attempts/{attempt_id}/{kind}", json=body, timeout=5)


def test_url_is_on_the_agent_address(api: LocalApi) -> None:
    assert api.url.startswith("http://127.0.0.2:")
    assert httpx.get(f"{api.url}/healthz").json() == {"ok": True}


def test_progress_keeps_the_highest_step(api: LocalApi) -> None:
    for step, loss in [(5, 0.5), (7, 0.4), (6, 0.45)]:
        resp = post(api, "att-1", "progress", {"fencing_token": "fence-1", "rank": 0, "step": step, "loss": loss})
        assert resp.status_code == 200, resp.text
    progress, result = api.reports.snapshot("att-1")
    assert progress is not None and progress.step == 7 and progress.loss == 0.4
    assert result is None


def test_result_prefers_rank_zero(api: LocalApi) -> None:
    assert post(api, "att-1", "result", {"fencing_token": "fence-1", "rank": 0, "result": {"x": 0}}).status_code == 200
    assert post(api, "att-1", "result", {"fencing_token": "fence-1", "rank": 1, "result": {"x": 1}}).status_code == 200
    assert api.reports.snapshot("att-1")[1] == {"x": 0}


def test_unknown_attempt_and_wrong_token_are_409(api: LocalApi) -> None:
    body = {"fencing_token": "fence-1", "rank": 0, "step": 1}
    for resp in (
        post(api, "att-2", "progress", body),
        post(api, "att-1", "progress", {**body, "fencing_token": "old"}),
        post(api, "att-1", "result", {"fencing_token": "old", "rank": 0, "result": {}}),
    ):
        assert resp.status_code == 409
        assert resp.headers["content-type"] == "application/problem+json"
        assert resp.json()["status"] == 409
    api.reports.unregister("att-1")
    assert post(api, "att-1", "progress", body).status_code == 409
    assert api.reports.snapshot("att-1") == (None, None)


def test_invalid_body_is_422_and_unknown_route_404(api: LocalApi) -> None:
    resp = post(api, "att-1", "progress", {"fencing_token": "fence-1", "rank": 0, "step": -1})
    assert resp.status_code == 422 and resp.json()["errors"]
    bad_json = httpx.post(f"{api.url}/v1/local/attempts/att-1/result", content=b"{nope", timeout=5)
    assert bad_json.status_code == 422
    assert post(api, "att-1", "other", {}).status_code == 404
