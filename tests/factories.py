"""Builders for test data, through the real API (no rows written behind the service's back)."""

from __future__ import annotations

import copy
from typing import Any

from fastapi.testclient import TestClient

from control_plane.schemas.jobs import SUBMIT_EXAMPLE

ADMIN_TOKEN = "test-admin-token"
JOIN_TOKEN = "test-join-token"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}

# The demo's submit body (scripts/demo.sh), defined once as the API schema's example.
TINY_GPT: dict[str, Any] = SUBMIT_EXAMPLE


def job_body(**overrides: Any) -> dict[str, Any]:
    body = copy.deepcopy(TINY_GPT)
    body.update(overrides)
    return body


STEPS_JOB = "tests/e2e/steps_job.py"


def steps_body(steps: int, delay_s: float = 0.0, **overrides: Any) -> dict[str, Any]:
    """A job that takes ``steps`` steps of ``delay_s`` and trains nothing (tests/e2e/steps_job.py), no
    checkpoints unless given: for end-to-end tests whose subject is where, when and how jobs run,
    not what they compute (a torch worker costs about 4 CPU-s to start on the 2-core test machine)."""
    return job_body(**{"entrypoint": STEPS_JOB, "checkpoint": {},
                       "args": ["--steps", str(steps), "--step-delay-s", str(delay_s)], **overrides})


def register_body(name: str, gpus: int = 2, *, address: str | None = None, kind: str = "virtual-cpu",
                  labels: dict[str, str] | None = None, memory_port: int | None = None,
                  memory_tls: bool = False) -> dict[str, Any]:
    return {
        "name": name,
        "address": address or "127.0.0.1",
        "gpus": [{"index": i, "uuid": f"virtual-{name}-{i}", "kind": kind, "memory_mb": 0} for i in range(gpus)],
        "labels": labels or {},
        **({"memory_port": memory_port} if memory_port is not None else {}),
        **({"memory_tls": True} if memory_tls else {}),
    }


def register_node(client: TestClient, name: str, gpus: int = 2, *, address: str | None = None,
                  kind: str = "virtual-cpu", labels: dict[str, str] | None = None,
                  token: str = JOIN_TOKEN, memory_port: int | None = None, memory_tls: bool = False) -> dict[str, Any]:
    """Register a new node with the static join token of the test settings (new names only)."""
    body = register_body(name, gpus, address=address, kind=kind, labels=labels, memory_port=memory_port,
                         memory_tls=memory_tls)
    r = client.post("/v1/agent/register", json=body, headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 200, r.text
    return r.json()


def reregister_node(client: TestClient, name: str, credential: str, gpus: int = 2, **kw: Any) -> dict[str, Any]:
    """Register a registered node again, as its agent does: with its own credential."""
    return register_node(client, name, gpus, token=credential, **kw)


class FakeAgentSession:
    """Speaks the agent wire protocol over HTTP for API-level tests of the protocol itself.

    End-to-end tests use the real node agent; this drives exact message sequences (duplicates,
    reordering, stale attempts) that a real agent produces only by chance.
    """

    def __init__(self, client: TestClient, name: str, gpus: int = 2, instance: str = "i1",
                 kind: str = "virtual-cpu", credential: str | None = None, *, address: str | None = None,
                 labels: dict[str, str] | None = None, memory_port: int | None = None,
                 memory_tls: bool = False) -> None:
        """``credential``: the node's own, to register a registered node again (as its agent does)."""
        reg = register_node(client, name, gpus, kind=kind, token=credential or JOIN_TOKEN, address=address,
                            labels=labels, memory_port=memory_port, memory_tls=memory_tls)
        self.token = reg["node_token"]
        self.client = client
        self.name = name
        self.node_id = reg["node_id"]
        self.headers = {"Authorization": f"Bearer {reg['node_token']}"}
        self.instance = instance
        self.seq = 0

    def heartbeat(self, alive: list[str] | None = None, *, seq: int | None = None) -> dict[str, Any]:
        if seq is None:
            self.seq += 1
            seq = self.seq
        r = self.client.post(
            "/v1/agent/heartbeat",
            json={"agent_instance": self.instance, "seq": seq, "attempts": [{"attempt_id": a} for a in alive or []]},
            headers=self.headers,
        )
        assert r.status_code == 200, r.text
        return r.json()

    def status(self, spec: dict[str, Any], state: str, *, exit_code: int | None = None,
               workers: list[dict[str, Any]] | None = None, token: str | None = None, **extra: Any):
        body = {
            "fencing_token": token or spec["fencing_token"],
            "node_rank": spec["node_rank"],
            "state": state,
            "exit_code": exit_code,
            "workers": workers if workers is not None else [],
            **extra,
        }
        return self.client.post(f"/v1/agent/attempts/{spec['attempt_id']}/status", json=body, headers=self.headers)


def workers_for(spec: dict[str, Any], state: str, exit_code: int | None = None) -> list[dict[str, Any]]:
    base = spec["node_rank"] * spec["nproc_per_node"]
    return [
        {"rank": base + i, "local_rank": i, "pid": 1000 + base + i, "state": state, "exit_code": exit_code}
        for i in range(spec["nproc_per_node"])
    ]
