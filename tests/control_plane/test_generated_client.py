"""A typed client generated from the OpenAPI document (openapi-python-client) works (issue 13):
generated without a warning, it submits, replays, gets, lists and cancels a job on a real control
plane (uvicorn, real PostgreSQL), and parses an error as a Problem instead of raising on an
undeclared status."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx

from control_plane.app import create_app
from tests.control_plane.helpers import serve
from tests.factories import ADMIN_TOKEN, job_body, register_node


def _generate(app, where: Path) -> str:
    spec = where / "openapi.json"
    spec.write_text(json.dumps(app.openapi()))
    bin_dir = str(Path(sys.executable).parent)  # ruff, which the generator formats its output with
    done = subprocess.run(
        [os.path.join(bin_dir, "openapi-python-client"), "generate", "--path", str(spec), "--meta", "none",
         "--output-path", str(where / "trainyard_client")],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "PATH": bin_dir + os.pathsep + os.environ["PATH"]})
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def test_a_generated_client_submits_gets_lists_and_cancels(settings, tmp_path, monkeypatch):
    app = create_app(settings)
    output = _generate(app, tmp_path)
    assert "Warning" not in output and "Skipping" not in output, output
    monkeypatch.syspath_prepend(str(tmp_path))
    client_mod = importlib.import_module("trainyard_client")
    models = importlib.import_module("trainyard_client.models")

    class jobs:  # noqa: N801 - the generated package's api/jobs/<operation>.py modules
        submit_job, get_job, list_jobs, cancel_job = (
            importlib.import_module(f"trainyard_client.api.jobs.{name}")
            for name in ("submit_job", "get_job", "list_jobs", "cancel_job"))

    with serve(app) as url:
        with httpx.Client(base_url=url) as raw:
            register_node(raw, "node-1", 2)  # type: ignore[arg-type]
        client = client_mod.AuthenticatedClient(base_url=url, token=ADMIN_TOKEN, raise_on_unexpected_status=True)
        body = models.JobSubmit.from_dict(job_body(num_nodes=1, name="generated"))
        created = jobs.submit_job.sync_detailed(client=client, body=body, idempotency_key="gen-1")
        assert created.status_code == 201 and isinstance(created.parsed, models.JobOut)
        job = created.parsed
        assert job.name == "generated" and job.state == "queued" and job.progress.step is None
        # The replay of an idempotent submit is a documented 200 with the same job, not an exception.
        again = jobs.submit_job.sync_detailed(client=client, body=body, idempotency_key="gen-1")
        assert again.status_code == 200 and again.parsed.id == job.id

        got = jobs.get_job.sync(client=client, job_id=job.id)
        assert isinstance(got, models.JobOut) and got.id == job.id
        page = jobs.list_jobs.sync(client=client)
        assert isinstance(page, models.JobPage) and [j.id for j in page.items] == [job.id]
        cancelled = jobs.cancel_job.sync(client=client, job_id=job.id)
        assert isinstance(cancelled, models.JobOut) and cancelled.state in ("cancelling", "cancelled")

        # An error is a declared Problem: the second cancel of a cancelled job is 409.
        refused = jobs.cancel_job.sync_detailed(client=client, job_id=job.id)
        assert refused.status_code == 409 and isinstance(refused.parsed, models.Problem)
        assert refused.parsed.detail
