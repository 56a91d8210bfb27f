"""The heartbeat delta protocol over HTTP on real Postgres (finding 21): an agent that reports the
specs it holds gets full specs only for new or changed assignments, a compact reference for the
rest, and the storage access only at registration (never a credential: issue 11, finding 3); an
old agent still gets full specs."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from control_plane.settings import Settings
from tests.factories import ADMIN, FakeAgentSession, job_body

SECRET = "s3-secret-never-sent-to-an-agent"
STORAGE = {"access": "presigned"}


@pytest.fixture
def settings(settings: Settings) -> Settings:
    # S3 configured (never reached in these tests): agents learn that there is storage, not its keys.
    return settings.model_copy(update={"s3_endpoint": "127.0.0.1:9", "s3_access_key": "ak", "s3_secret_key": SECRET})


class DeltaAgent(FakeAgentSession):
    """A fake agent that reports the specs it holds, as the real agent does."""

    def __init__(self, client: TestClient, name: str, gpus: int = 2) -> None:
        super().__init__(client, name, gpus)
        self.held: dict[str, str] = {}

    def beat(self, alive: list[str] | None = None, *, known: dict[str, str] | None = None) -> tuple[dict, int]:
        self.seq += 1
        body = {
            "agent_instance": self.instance, "seq": self.seq,
            "attempts": [{"attempt_id": a} for a in alive or []],
            "known": [{"attempt_id": a, "version": v} for a, v in (self.held if known is None else known).items()],
        }
        r = self.client.post("/v1/agent/heartbeat", json=body, headers=self.headers)
        assert r.status_code == 200, r.text
        resp = r.json()
        assigned = {s["attempt_id"] for s in resp["assignments"]}
        assigned |= {u["attempt_id"] for u in resp["unchanged"] if u["desired"] == "run"}
        self.held = {a: v for a, v in self.held.items() if a in assigned}
        self.held.update({s["attempt_id"]: s["version"] for s in resp["assignments"]})
        return resp, len(r.content)


def _steady_size(client: TestClient, schedule: Any, num_nodes: int, gpus: int, args: list[str]) -> dict[str, Any]:
    agents = [DeltaAgent(client, f"n{num_nodes}-{i}", gpus) for i in range(num_nodes)]
    job = client.post("/v1/jobs", json=job_body(name=f"j{num_nodes}", num_nodes=num_nodes, gpus_per_node=gpus,
                                                args=args, env={"BIG": "x" * 2000}), headers=ADMIN).json()
    assert schedule() == 1
    first = [a.beat() for a in agents]
    second = [a.beat([next(iter(a.held))]) for a in agents]
    return {"job": job, "agents": agents, "first": first, "second": second}


def test_unchanged_assignment_is_a_small_reference_whatever_the_job_size(client, schedule):
    small = _steady_size(client, schedule, 2, 2, ["--steps", "3"])
    big = _steady_size(client, schedule, 8, 4, ["--arg"] * 900)
    for run in (small, big):
        for (resp1, _), (resp2, size2) in zip(run["first"], run["second"], strict=True):
            [spec] = resp1["assignments"]
            assert spec["version"] and resp1["unchanged"] == []
            assert SECRET not in str(resp1) and set(spec["storage"]) == {"prefix"}
            assert resp2["assignments"] == []
            assert resp2["unchanged"] == [{"attempt_id": spec["attempt_id"], "desired": "run",
                                           "version": spec["version"], "handover_ok": False}]
            assert size2 < 400
    first_small = max(size for _, size in small["first"])
    first_big = max(size for _, size in big["first"])
    assert first_big > first_small + 5000  # the full spec does carry the job's arguments ...
    # ... the steady state does not: the same bytes for 4 ranks with 2 args and 32 ranks with 900.
    assert {size for _, size in small["second"]} == {size for _, size in big["second"]}


def test_storage_access_comes_once_at_registration_without_credentials_and_old_agents_get_full_specs(client, schedule):
    new = DeltaAgent(client, "new")
    old = DeltaAgent(client, "old")
    reg = client.post("/v1/agent/register", headers=new.headers,  # registered again, with its credential
                      json={"name": "new", "address": "127.0.0.1", "gpus": [
                          {"index": i, "uuid": f"virtual-new-{i}", "kind": "virtual-cpu", "memory_mb": 0}
                          for i in range(2)]}).json()
    assert reg["storage"] == STORAGE and SECRET not in str(reg)
    new.headers = {"Authorization": f"Bearer {reg['node_token']}"}
    client.post("/v1/jobs", json=job_body(), headers=ADMIN)
    assert schedule() == 1
    [spec_new] = new.beat()[0]["assignments"]
    assert set(spec_new["storage"]) == {"prefix"}
    for _ in range(2):  # no `known`: the full spec every time, as before
        [spec_old] = old.heartbeat()["assignments"]
        assert spec_old["storage"] == {**STORAGE, "prefix": spec_old["storage"]["prefix"]}
        assert SECRET not in str(spec_old)
    # Credentials are not part of the version: the same agent, upgraded, keeps that spec.
    resp, _ = old.beat([spec_old["attempt_id"]], known={spec_old["attempt_id"]: spec_old["version"]})
    assert resp["assignments"] == [] and resp["unchanged"][0]["desired"] == "run"


def test_changed_version_resends_the_spec_and_unassigned_known_specs_are_told_to_stop(client, schedule):
    a, b = DeltaAgent(client, "a"), DeltaAgent(client, "b")
    job = client.post("/v1/jobs", json=job_body(), headers=ADMIN).json()
    assert schedule() == 1
    [spec] = a.beat()[0]["assignments"]
    b.beat()
    attempt = spec["attempt_id"]
    # A version the control plane never gave (an agent holding an outdated spec): the spec again.
    resp, _ = a.beat([attempt], known={attempt: "0" * 16})
    assert [s["attempt_id"] for s in resp["assignments"]] == [attempt] and resp["unchanged"] == []
    assert a.held == {attempt: spec["version"]}
    # The job is cancelled: the agent is told to stop the spec it holds, by reference.
    assert client.post(f"/v1/jobs/{job['id']}/cancel", headers=ADMIN).status_code in (200, 202)
    resp, size = a.beat([attempt])
    assert resp["assignments"] == []
    assert resp["unchanged"] == [{"attempt_id": attempt, "desired": "stop", "version": spec["version"],
                                   "handover_ok": False}]
    assert a.held == {}
    resp, _ = a.beat([])  # forgotten: nothing more about it
    assert resp["assignments"] == [] and resp["unchanged"] == []


def test_bad_known_entries_are_refused_with_a_problem(client):
    a = DeltaAgent(client, "a")
    r = client.post("/v1/agent/heartbeat", headers=a.headers, json={
        "agent_instance": "i1", "seq": 1, "known": [{"attempt_id": "x" * 500, "version": "v"}]})
    assert r.status_code == 422 and r.headers["content-type"].startswith("application/problem+json")
    r = client.post("/v1/agent/heartbeat", headers=a.headers, json={
        "agent_instance": "i1", "seq": 1, "known": [{"attempt_id": "unknown", "version": "v"}]})
    assert r.status_code == 200 and r.json()["unchanged"] == [
        {"attempt_id": "unknown", "desired": "stop", "version": "v", "handover_ok": False}]
