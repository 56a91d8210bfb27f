"""Attempts and checkpoints are paginated like jobs (issue 11, finding 9): `limit` and `cursor` in,
`items` and `next_cursor` out, every item once, in a stable order."""

from __future__ import annotations

from tests.factories import ADMIN, FakeAgentSession, job_body, workers_for


def _pages(client, path: str, limit: int) -> list[list[dict]]:
    pages, cursor = [], None
    while True:
        params = {"limit": limit, **({"cursor": cursor} if cursor else {})}
        page = client.get(path, params=params, headers=ADMIN).json()
        pages.append(page["items"])
        cursor = page["next_cursor"]
        if cursor is None:
            return pages


def test_attempts_page_oldest_first_with_their_recovery(client, schedule):
    agents = [FakeAgentSession(client, "node-1", 1), FakeAgentSession(client, "node-2", 1)]
    job = client.post("/v1/jobs", json=job_body(num_nodes=1, gpus_per_node=1, max_failures=5), headers=ADMIN).json()
    for _ in range(3):  # three attempts fail (a node blamed twice is avoided: two nodes), a fourth runs
        assert schedule() == 1
        agent, spec = next((a, s) for a in agents for s in a.heartbeat()["assignments"])
        agent.status(spec, "exited", exit_code=1, workers=workers_for(spec, "exited", 1))
        agent.heartbeat([])
    assert schedule() == 1
    pages = _pages(client, f"/v1/jobs/{job['id']}/attempts", 3)
    assert [[a["number"] for a in p] for p in pages] == [[1, 2, 3], [4]]
    whole = client.get(f"/v1/jobs/{job['id']}/attempts", headers=ADMIN).json()
    assert whole["next_cursor"] is None and [a["number"] for a in whole["items"]] == [1, 2, 3, 4]
    # An attempt's recovery is measured from the one before it, also across a page boundary.
    assert pages[1][0]["recovery"]["after_attempt"] == 3 and pages[1][0] == whole["items"][3]


def test_checkpoints_page_newest_first(client, schedule):
    agents = [FakeAgentSession(client, "node-1", 1), FakeAgentSession(client, "node-2", 1)]
    job = client.post("/v1/jobs", json=job_body(num_nodes=2, gpus_per_node=1), headers=ADMIN).json()
    assert schedule() == 1
    agent, spec = next((a, s) for a in agents for s in a.heartbeat()["assignments"] if s["node_rank"] == 0)
    steps = [10, 20, 30, 40, 50]
    shards = [{"rank": 0, "step": step, "world_size": 2, "size_bytes": 1, "sha256": "0" * 64,
               "key": f"jobs/{job['id']}/checkpoints/step-{step:09d}/attempt-0001/rank-00000.pt"} for step in steps]
    r = client.post(f"/v1/agent/attempts/{spec['attempt_id']}/shards", headers=agent.headers,
                    json={"fencing_token": spec["fencing_token"], "node_rank": 0, "shards": shards})
    assert r.status_code == 200, r.text
    pages = _pages(client, f"/v1/jobs/{job['id']}/checkpoints", 2)
    assert [[c["step"] for c in p] for p in pages] == [[50, 40], [30, 20], [10]]
