"""Shipped code through the control plane (issue 13): uploaded once per content hash for the
caller's tenant, named by a job (refused when it was not uploaded for that tenant), handed to
the nodes of the job's live attempt only, with its hash in the launch spec; a job's interpreter
on the nodes (an absolute path) travels with it."""

from __future__ import annotations

import hashlib
import io
import os
import tarfile

import pytest
from fastapi.testclient import TestClient

from control_plane.app import create_app
from control_plane.settings import Settings
from tests.control_plane.access import make_principal
from tests.factories import ADMIN, FakeAgentSession, job_body


def _archive(text: str) -> bytes:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w:gz") as tar:
        data = text.encode()
        info = tarfile.TarInfo("train.py")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return raw.getvalue()


@pytest.fixture
def s3_client(settings: Settings, s3_bucket):
    app = create_app(settings.model_copy(update={
        "s3_endpoint": s3_bucket.endpoint, "s3_access_key": s3_bucket.access_key,
        "s3_secret_key": s3_bucket.secret_key, "s3_bucket": s3_bucket.bucket}))
    with TestClient(app) as client:
        yield app, client


def test_code_is_uploaded_once_named_by_a_job_and_fetched_by_its_nodes_only(s3_client):
    app, client = s3_client
    a, b = FakeAgentSession(client, "node-1", 2), FakeAgentSession(client, "node-2", 2)
    data = _archive("print('shipped')\n")
    sha = hashlib.sha256(data).hexdigest()
    gz = {**ADMIN, "Content-Type": "application/octet-stream"}
    assert client.get(f"/v1/code/{sha}", headers=ADMIN).status_code == 404
    first = client.put(f"/v1/code/{sha}", content=data, headers=gz)
    assert first.status_code == 201 and first.json() == {"sha256": sha, "size_bytes": len(data)}
    assert client.put(f"/v1/code/{sha}", content=data, headers=gz).status_code == 200  # stored once
    assert client.get(f"/v1/code/{sha}", headers=ADMIN).status_code == 200
    cut = client.put(f"/v1/code/{sha}", content=data[:-5], headers=gz)
    assert cut.status_code == 422 and "sha256" in cut.json()["detail"]

    # Another tenant cannot name it, even knowing its hash, nor upload for a tenant not its own.
    other = make_principal(client, "bob", "member", "nlp")
    refused = client.post("/v1/jobs", json=job_body(num_nodes=1, code={"sha256": sha}), headers=other.headers)
    assert refused.status_code == 422 and "not uploaded for tenant nlp" in refused.json()["detail"]
    assert client.put(f"/v1/code/{sha}", params={"tenant": "default"}, content=data,
                      headers={**other.headers, "Content-Type": "application/octet-stream"}).status_code == 403
    # An admin uploads for a team and submits on its behalf.
    assert client.put(f"/v1/code/{sha}", params={"tenant": "nlp"}, content=data, headers=gz).status_code == 201
    assert client.get(f"/v1/code/{sha}", headers=other.headers).status_code == 200

    job = client.post("/v1/jobs", json=job_body(num_nodes=1, entrypoint="train.py", code={"sha256": sha},
                                                python="/opt/envs/llm/bin/python"), headers=ADMIN).json()
    assert job["code"] == {"sha256": sha, "size_bytes": len(data)} and job["python"] == "/opt/envs/llm/bin/python"
    relative = client.post("/v1/jobs", json=job_body(num_nodes=1, python="bin/python"), headers=ADMIN)
    assert relative.status_code == 422 and "python" in relative.json()["detail"]
    app.state.loops.schedule_once()
    specs = {agent.name: agent.heartbeat()["assignments"] for agent in (a, b)}
    holder, idle = (a, b) if specs["node-1"] else (b, a)
    (spec,) = specs[holder.name]
    assert spec["code"] == {"sha256": sha, "size_bytes": len(data)} and spec["python"] == "/opt/envs/llm/bin/python"
    got = client.get(f"/v1/agent/attempts/{spec['attempt_id']}/code", headers=holder.headers)
    assert got.status_code == 200 and got.content == data and got.headers["X-Content-SHA256"] == sha
    assert client.get(f"/v1/agent/attempts/{spec['attempt_id']}/code", headers=idle.headers).status_code == 409
    client.post(f"/v1/jobs/{job['id']}/cancel", headers=ADMIN)
    holder.status(spec, "stopped", exit_code=-15)
    holder.heartbeat([])
    assert client.get(f"/v1/agent/attempts/{spec['attempt_id']}/code", headers=holder.headers).status_code == 409


def test_without_s3_code_is_refused_in_one_line(client):
    r = client.get(f"/v1/code/{'0' * 64}", headers=ADMIN)
    assert r.status_code == 422 and "needs S3" in r.json()["detail"]


def test_requirements_travel_to_the_nodes_and_an_install_that_fails_is_not_retried(client):
    """A job's requirements (the text of its requirements file) reach its launch spec; lines that
    would read files or build from source are refused at submit; an agent whose install fails
    says start_error, and the job fails at once with that reason instead of being retried."""
    agent = FakeAgentSession(client, "node-1", 1)
    for bad, said in (("-r other.txt\n", "-r other.txt"), ("--no-bin :all:\nfoo\n", "--no-bin"),
                      ("# nothing\n", "name no package"), ("foo\0\n", "plain text"),
                      ("evilpkg @ file:///srv/evilpkg-1.0.tar.gz\n", "never a URL, a path or 'name @ url'"),
                      ("https://attacker/evilpkg-1.0.tar.gz\n", "never a URL")):
        r = client.post("/v1/jobs", json=job_body(num_nodes=1, requirements=bad), headers=ADMIN)
        assert r.status_code == 422 and said in r.json()["detail"], r.text
    requirements = "--no-index\n--find-links /srv/wheels\ntinypkg==1.0  # the job's own\n"
    job = client.post("/v1/jobs", json=job_body(num_nodes=1, gpus_per_node=1, requirements=requirements,
                                                max_failures=3), headers=ADMIN).json()
    assert job["requirements"] == requirements
    client.app.state.loops.schedule_once()
    (spec,) = agent.heartbeat()["assignments"]
    assert spec["requirements"] == requirements
    reason = "could not install the job's requirements (pip exit 1): No matching distribution found for tinypkg==1.0"
    r = agent.status(spec, "exited", error=reason, error_kind="start_error")
    assert r.status_code == 200, r.text
    done = client.get(f"/v1/jobs/{job['id']}", headers=ADMIN).json()
    assert done["state"] == "failed" and "cannot start" in done["end_reason"] and reason in done["end_reason"], done
    (attempt,) = client.get(f"/v1/jobs/{job['id']}/attempts", headers=ADMIN).json()["items"]
    assert attempt["failure_kind"] == "start_error"


def test_the_cli_ships_a_workdir_once_says_so_and_names_the_limit(settings, s3_bucket, tmp_path, monkeypatch):
    """Issue 26 item 6, against a real control plane and S3: `trainyard run` says what it ships (files,
    size, packed size, sha256); an unchanged workdir is asked for by the hash of its last archive
    without packing it again; over the control plane's limit for code, one line names the limit and
    the way out."""
    from tests.control_plane.helpers import serve
    from tests.factories import ADMIN_TOKEN
    from trainyard.cli import code_ship
    from trainyard.cli.api_client import Api, ApiError

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    work = tmp_path / "w"
    (work / "data").mkdir(parents=True)
    (work / "train.py").write_text("print('hi')\n")
    (work / "data" / "shard.bin").write_bytes(os.urandom(300_000))
    packs: list[object] = []
    real_pack = code_ship.pack
    monkeypatch.setattr(code_ship, "pack", lambda w: packs.append(w) or real_pack(w))
    limited = settings.model_copy(update={
        "s3_endpoint": s3_bucket.endpoint, "s3_access_key": s3_bucket.access_key,
        "s3_secret_key": s3_bucket.secret_key, "s3_bucket": s3_bucket.bucket, "max_code_bytes": 200_000})
    with serve(create_app(limited)) as url:
        api = Api(url=url, token=ADMIN_TOKEN)
        said: list[str] = []
        with pytest.raises(ApiError) as over:
            code_ship.ship(api, work, say=said.append)
        assert over.value.status == 413 and ".trainyardignore" in str(over.value) and "MB" in str(over.value)
        assert "2 files" in said[0] and "packed" in said[0] and "uploading" in said[0]

        (work / ".trainyardignore").write_text("data/\n")
        said.clear()
        first = code_ship.ship(api, work, say=said.append)
        assert said[-1].startswith("code: uploaded") and "2 files" in said[0], said
        assert api.get(f"/v1/code/{first['sha256']}")["sha256"] == first["sha256"]
        packed = len(packs)
        said.clear()
        assert code_ship.ship(api, work, say=said.append) == first and len(packs) == packed
        assert "unchanged" in said[0] and "already on the control plane" in said[0], said
        (work / "train.py").write_text("print('changed')\n")
        assert code_ship.ship(api, work, say=said.append) != first and len(packs) == packed + 1
