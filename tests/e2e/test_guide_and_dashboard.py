"""End to end on one `trainyard dev up` (2 nodes x 1 GPU slot), as a user would (issue 13):

- the guide's example (docs/writing-jobs.md), run as written with the CLI: `trainyard login`,
  `trainyard run examples/minimal.yaml`, `trainyard dev node kill-workers`, `trainyard logs -f`;
  it recovers from its checkpoint and ends with exactly the weights of the same script run by a
  plain `torchrun` (no Trainyard: the unmodified path);
- a job file with a `requirements_file` (a local wheel, no network): each node installs it into a
  cached venv and the job imports it; requirements that do not install fail the job at once
  (start_error) with pip's reason in `trainyard describe`;
- the cluster commands against the real agents: `ps` lists the running job, `tenants` its GPUs,
  `cancel` stops its real workers (their processes gone, the GPUs free), `nodes cordon` keeps new
  work off a node, `nodes drain` lets a running job finish and takes nothing new, `nodes uncordon`
  gives the node back;
- the dashboard in real headless Chromium (Debian's package, driven by Playwright): login, a
  running job's progress, its followed log, the GPU grid, the cluster page, and cancel; the
  screenshots are kept under the test's tmp dir (the path is printed).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.harness import Cluster
from tests.factories import STEPS_JOB, steps_body
from tests.helpers import ProcessReaper, make_wheel, need, pid_gone, wait_for
from trainyard.cli import main
from trainyard.cli.tls import client_context
from trainyard.embedded import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.standbys]  # recoveries: later attempts fork warm (tests/conftest.py)
ROOT = Path(__file__).resolve().parents[2]
ENDED = {"succeeded", "failed", "cancelled"}


@pytest.fixture
def guide_cluster(tmp_path_factory: pytest.TempPathFactory, embedded_pg: Any, _schema_template: Any,
                  embedded_s3: Any) -> Iterator[tuple[Cluster, Path]]:
    """`trainyard dev up --nodes 2 --gpus-per-node 1`, as the guide starts it."""
    base = tmp_path_factory.mktemp("guide")
    database = f"trainyard_guide_{secrets.token_hex(4)}"
    url = embedded_pg.create_database(database, template=_schema_template.get())
    bucket = f"guide-{secrets.token_hex(4)}"
    embedded_s3.client().make_bucket(bucket)
    # dev up stops its agents, then the rest, with 10 s of grace each; killed sooner (the reaper's
    # default is 5 s), it would leave them running, each in its own session, past the test.
    reaper = ProcessReaper(grace_s=30)
    port, data_dir, log = free_port(), base / "cluster", base / "dev-up.log"
    with log.open("w") as out:
        proc = reaper.spawn(
            [sys.executable, "-m", "trainyard", "dev", "up", "--nodes", "2", "--gpus-per-node", "1", "--port",
             str(port), "--data-dir", str(data_dir), "--database-url", url, "--s3-endpoint", embedded_s3.endpoint,
             "--s3-access-key", embedded_s3.access_key, "--s3-bucket", bucket],
            stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
            env={**os.environ, "TRAINYARD_NODE_LOST_TIMEOUT_S": "6", "TRAINYARD_S3_SECRET_KEY": embedded_s3.secret_key})
        try:
            deadline = time.monotonic() + 180
            while "TRAINYARD_READY" not in log.read_text():
                assert proc.poll() is None, f"dev up exited early:\n{log.read_text()[-3000:]}"
                assert time.monotonic() < deadline, f"dev up not ready:\n{log.read_text()[-3000:]}"
                time.sleep(0.2)
            token = (data_dir / "admin.token").read_text().strip()
            # dev up serves HTTPS: the ready line names the URL and the CA its certificate is from.
            line = log.read_text().split("TRAINYARD_READY ", 1)[1].split("\n")[0]
            ready = dict(field.split("=", 1) for field in line.split())
            assert ready["url"] == f"https://127.0.0.1:{port}" and ready["token"] == token, ready
            verify = client_context(ready["ca"])
            with httpx.Client(base_url=ready["url"], headers={"Authorization": f"Bearer {token}"}, timeout=30,
                              verify=verify) as http:
                yield Cluster(url=ready["url"], token=token, http=http, log=log, verify=verify), data_dir
        finally:
            reaper.reap()
            embedded_pg.drop_database(database)


def _cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as done:
        main(args)
    out, err = capsys.readouterr()
    return int(done.value.code or 0), out, err


def _plain_torchrun(reaper: ProcessReaper, steps: int) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINYARD_")}
    env.update(OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
    return reaper.spawn([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                         "examples/train_minimal.py", "--steps", str(steps)],
                        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.timeout(600)  # the guide, the requirements, the dashboard, /docs and a recovery in the browser
def test_the_guides_example_then_the_dashboard(guide_cluster, tmp_path, monkeypatch, capsys, process_reaper):
    """One test, one cluster: pytest-xdist's worksteal may give two tests of a module to two workers,
    each of which would start its own cluster."""
    cluster, data_dir = guide_cluster
    _guide(cluster, data_dir, tmp_path, monkeypatch, capsys, process_reaper)
    started = time.monotonic()
    _requirements_and_cluster_commands(cluster, tmp_path, capsys)
    print(f"\nrequirements and cluster commands: {time.monotonic() - started:.1f}s")
    _dashboard(cluster, tmp_path, data_dir, capsys)


def _guide(cluster: Cluster, data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
           capsys: pytest.CaptureFixture[str], process_reaper: ProcessReaper) -> None:
    monkeypatch.setenv("TRAINYARD_CONFIG", str(tmp_path / "config.json"))
    monkeypatch.delenv("TRAINYARD_TOKEN", raising=False)
    monkeypatch.delenv("TRAINYARD_URL", raising=False)
    spec = (ROOT / "examples" / "minimal.yaml").read_text()
    steps = int(spec.split('"--steps", "')[1].split('"')[0])
    reference = _plain_torchrun(process_reaper, steps)  # the same script, no Trainyard, meanwhile

    code, _, err = _cli(["login", cluster.url, "--token-file", str(data_dir / "admin.token"), "--ca-file",
                         str(data_dir / "tls" / "ca.pem")], capsys)
    assert code == 0, err
    code, out, err = _cli(["run", str(ROOT / "examples" / "minimal.yaml")], capsys)
    assert code == 0, err
    job_id = out.strip()
    cluster.wait_for("a committed checkpoint", lambda: [
        c for c in cluster.get(f"/v1/jobs/{job_id}/checkpoints")["items"] if c["state"] == "committed"], 180)
    code, _, err = _cli(["dev", "node", "kill-workers", "node-2", "--data-dir", str(data_dir)], capsys)
    assert code == 0 and "killed" in err, err

    code, out, err = _cli(["logs", "minimal", "-f"], capsys)  # follows until the job ends
    assert code == 0, f"{err}\n{out[-3000:]}"
    assert "job minimal succeeded" in err and "trainyard: restored step" in out
    job = cluster.job(job_id)
    attempts = cluster.get(f"/v1/jobs/{job_id}/attempts")["items"]
    assert len(attempts) == 2 and attempts[0]["failure_kind"] == "signal", attempts[0]
    assert attempts[1]["restored_from_step"] >= 25 and attempts[1]["recovery"]["to_first_step_s"] > 0
    assert job["progress"]["total_steps"] == steps and job["progress"]["step"] == steps
    # Issue 26: the followed log said, as it happened, that attempt 1 failed and why, and where the
    # recovery resumed (stderr lines between the log's).
    assert "trainyard: attempt 1 failed (" in err and "); recovery 1 of 3" in err, err
    resumed = f"trainyard: recovery: attempt 2 resumes from checkpoint step {attempts[1]['restored_from_step']}"
    assert resumed in err, err

    stdout, stderr = reference.communicate(timeout=300)
    assert reference.returncode == 0, stderr[-2000:]
    [line] = [line for line in stdout.splitlines() if line.startswith("{")]
    plain = json.loads(line)
    assert plain["restored_from_step"] is None and plain["steps"] == steps
    assert job["result"]["weights_sha256"] == plain["weights_sha256"]
    assert job["result"]["restored_from_step"] == attempts[1]["restored_from_step"]

    code, out, err = _cli(["describe", "minimal"], capsys)
    assert code == 0 and "recovery from #1" in out and "[signal] rank" in out, out


TRAIN_WITH_REQUIREMENT = """\
import runpy, sys
import tinypkg  # from the job's requirements, installed by the agent

print(f"tinypkg says {tinypkg.MARK} from {tinypkg.__file__}", flush=True)
sys.argv = ["steps_job.py", *sys.argv[1:]]
runpy.run_path("steps_job.py", run_name="__main__")  # takes steps, trains nothing
"""


def _requirements_and_cluster_commands(cluster: Cluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # pip runs as the part's uid (issue 23): a --find-links folder must be one that uid can read, which
    # pytest's private tmp_path is not.
    wheels = Path(tempfile.mkdtemp(prefix="trainyard-e2e-guide-wheels-", dir="/tmp"))
    wheels.chmod(0o755)
    make_wheel(wheels, "tinypkg", "1.0", "MARK = 'hello'\n")
    job_dir = tmp_path / "reqjob"
    job_dir.mkdir()
    shutil.copy(ROOT / STEPS_JOB, job_dir)
    (job_dir / "train.py").write_text(TRAIN_WITH_REQUIREMENT)
    index = f"--no-index\n--find-links {wheels}\n"
    (job_dir / "requirements.txt").write_text(f"{index}tinypkg==1.0\n")
    (job_dir / "bad.txt").write_text(f"{index}tinypkg==9.9\n")
    common = "workdir: .\nentrypoint: train.py\ngpus_per_node: 1\nmax_failures: 3\n"
    (job_dir / "bad.yaml").write_text(f"name: badreqs\nnum_nodes: 1\nrequirements_file: bad.txt\n{common}")
    (job_dir / "job.yaml").write_text(f"name: reqs\nnum_nodes: 2\nrequirements_file: requirements.txt\n{common}"
                                      'args: ["--steps", "3000", "--step-delay-s", "0.05"]\n')

    # Requirements that cannot install: failed at once, not retried, pip's reason in one line.
    code, out, err = _cli(["run", str(job_dir / "bad.yaml")], capsys)
    assert code == 0, err
    bad = cluster.wait_state(out.strip(), ENDED, timeout=90)
    attempts = cluster.get(f"/v1/jobs/{bad['id']}/attempts")["items"]
    assert bad["state"] == "failed" and len(attempts) == 1 and attempts[0]["failure_kind"] == "start_error", bad
    assert "\n" not in bad["end_reason"] and "could not install the job's requirements" in bad["end_reason"], bad
    code, out, err = _cli(["describe", "badreqs"], capsys)
    said = " ".join(out.split())  # the reason is one line, folded at the console's width
    assert code == 0 and "[start_error] node rank 0 on node-" in said, out
    assert "No matching distribution found for tinypkg==9.9" in said, out

    code, out, err = _cli(["run", str(job_dir / "job.yaml")], capsys)
    assert code == 0, err
    job_id = out.strip()
    cluster.wait_for("reqs running", lambda: (cluster.job(job_id)["progress"]["step"] or 0) >= 5, 120)
    shutil.rmtree(wheels, ignore_errors=True)  # installed: every node built its venv
    code, out, err = _cli(["logs", "reqs"], capsys)
    said = [line for line in out.splitlines() if "tinypkg says hello from" in line]
    assert code == 0 and len(said) == 2 and all("/envs/" in line for line in said), out[-2000:]

    code, out, err = _cli(["ps"], capsys)
    assert code == 0 and [line for line in out.splitlines()
                          if line.split()[:4] == [job_id[:8], "reqs", "default", "running"]], out
    code, out, err = _cli(["tenants"], capsys)
    (row,) = [line.split() for line in out.splitlines() if line.split()[:1] == ["default"]]
    usage = next(t for t in cluster.get("/v1/tenants") if t["name"] == "default")
    assert code == 0 and usage["gpus_in_use"] == 2 and usage["jobs_running"] == 1 and row[-3:] == ["2", "0", "1"], out

    # Cancel: the real workers end, and the GPUs are free.
    pids = [w["pid"] for n in cluster.get(f"/v1/jobs/{job_id}/attempts")["items"][-1]["nodes"] for w in n["workers"]]
    assert len(pids) == 2 and all(pids), pids
    code, out, err = _cli(["nodes", "cordon", "node-1"], capsys)
    assert code == 0 and "node-1: cordoned" in err, err
    code, out, err = _cli(["cancel", "reqs"], capsys)
    assert code == 0 and "reqs" in err, err
    assert cluster.wait_state(job_id, ENDED, timeout=60)["state"] == "cancelled"
    wait_for(lambda: all(pid_gone(pid) for pid in pids), 30, what="the cancelled job's workers to exit")
    wait_for(lambda: not [g for n in cluster.get("/v1/nodes") for g in n["gpus"] if g.get("job_id")], 30,
             what="the GPUs to be released")

    # Cordoned node-1 takes nothing: a one-GPU job goes to node-2, which then drains under it.
    def node_of(job: str) -> str | None:
        attempts = cluster.get(f"/v1/jobs/{job}/attempts")["items"]
        return attempts[-1]["nodes"][0]["node_name"] if attempts else None

    one_gpu = {"num_nodes": 1, "gpus_per_node": 1}  # jobs that take steps and train nothing: placement matters here
    probe = cluster.submit(steps_body(60, 0.05, name="probe", **one_gpu))
    cluster.wait_for("probe placed", lambda: node_of(probe["id"]), 60)
    assert node_of(probe["id"]) == "node-2"
    code, out, err = _cli(["nodes", "drain", "node-2"], capsys)
    assert code == 0 and "node-2: draining" in err, err
    waiter = cluster.submit(steps_body(5, name="waiter", **one_gpu))
    assert cluster.wait_state(probe["id"], ENDED, timeout=120)["state"] == "succeeded"  # drain let it finish
    cluster.wait_for("node-2 drained", lambda: [n for n in cluster.get("/v1/nodes")
                                                if n["name"] == "node-2" and n["scheduling"] == "drained"], 30)
    code, out, err = _cli(["nodes"], capsys)
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith("node-")}
    assert rows["node-1"][2] == "cordoned" and rows["node-2"][2] == "drained", out
    assert cluster.job(waiter["id"])["state"] == "queued" and node_of(waiter["id"]) is None
    code, out, err = _cli(["nodes", "uncordon", "node-1"], capsys)
    assert code == 0 and "node-1: schedulable" in err, err
    cluster.wait_for("waiter placed", lambda: node_of(waiter["id"]), 60)
    assert node_of(waiter["id"]) == "node-1"
    code, out, err = _cli(["nodes", "uncordon", "node-2"], capsys)
    assert code == 0 and "node-2: schedulable" in err, err
    cluster.http.post(f"/v1/jobs/{waiter['id']}/cancel")
    cluster.wait_state(waiter["id"], ENDED, timeout=60)
    wait_for(lambda: not [g for n in cluster.get("/v1/nodes") for g in n["gpus"] if g.get("job_id")], 30,
             what="the GPUs to be released")


def _dashboard(cluster: Cluster, tmp_path: Path, data_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    need(chromium is not None, "the dashboard test needs Debian's chromium (scripts/system-deps.sh installs it)")
    from playwright import sync_api
    shots = tmp_path / "screenshots"
    shots.mkdir()
    r = cluster.http.post("/v1/jobs", json={
        "name": "watched", "num_nodes": 2, "gpus_per_node": 1, "entrypoint": "examples/train_minimal.py",
        "args": ["--steps", "3000", "--step-time-s", "0.05"], "checkpoint": {"interval_steps": 100}})
    assert r.status_code == 201, r.text
    job = r.json()
    cluster.wait_for("progress", lambda: (cluster.job(job["id"])["progress"]["step"] or 0) >= 20, 180)

    with sync_api.sync_playwright() as p:
        # CI runs as root (no sandbox) and maybe in a container whose /dev/shm is 64 MiB.
        browser = p.chromium.launch(executable_path=chromium,
                                    args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        # The dev cluster's CA is not the browser's: trust its certificate for this test.
        page = browser.new_context(ignore_https_errors=True, viewport={"width": 1400, "height": 1000}).new_page()
        page.goto(f"{cluster.url}/ui")
        assert "/ui/login" in page.url
        page.fill("#token", cluster.token)
        page.click("button[type=submit]")
        page.wait_for_url(f"{cluster.url}/ui")
        row = page.locator("tr[data-job]", has_text="watched")
        row.locator(".progress-step").wait_for()
        first = row.locator(".progress-step").inner_text()
        assert first.endswith("/3000"), first
        # The jobs list refreshes itself: the step moves on without a reload.
        wait_for(lambda: row.locator(".progress-step").inner_text() != first, 30, what="the list's progress")
        page.screenshot(path=str(shots / "jobs.png"), full_page=True)

        row.locator("a").first.click()
        page.wait_for_url(f"{cluster.url}/ui/jobs/{job['id']}")
        # The example prints its loss every 100 steps (5 s here): the followed log shows them as they come.
        page.wait_for_function("document.getElementById('log').textContent.includes('[a1 n0 r0] step ')",
                               timeout=30_000)
        seen = len(page.locator("#log").inner_text())
        wait_for(lambda: len(page.locator("#log").inner_text()) > seen, 30, what="the followed log to grow")
        line = page.locator("svg.chart polyline").first
        line.wait_for(state="attached")  # a flat line has no height: attached, not "visible"
        assert len((line.get_attribute("points") or "").split()) >= 2
        assert page.locator("#job-state").inner_text() == "running"
        page.screenshot(path=str(shots / "job.png"), full_page=True)

        page.goto(f"{cluster.url}/ui/nodes")
        assert page.locator(".gpu.held[title*='watched']").count() == 2  # one GPU on each node
        page.screenshot(path=str(shots / "nodes.png"), full_page=True)
        page.goto(f"{cluster.url}/ui/cluster")
        assert page.locator("#utilization").inner_text() == "100%"
        page.screenshot(path=str(shots / "cluster.png"), full_page=True)

        _api_pages(cluster, page, shots)
        _failure_and_recovery(cluster, page, shots, job, data_dir, capsys)

        page.goto(f"{cluster.url}/ui/jobs/{job['id']}")
        page.on("dialog", lambda dialog: dialog.accept())
        page.click("#cancel")
        page.wait_for_function("['cancelling', 'cancelled'].includes(document.getElementById('job-state')"
                               ".textContent)", timeout=30_000)
        done = cluster.wait_state(job["id"], ENDED, timeout=60)
        assert done["state"] == "cancelled", done
        page.reload()
        page.wait_for_function("document.getElementById('job-state').textContent === 'cancelled'", timeout=30_000)
        page.screenshot(path=str(shots / "cancelled.png"), full_page=True)
        browser.close()
    print(f"\ndashboard screenshots: {shots}")
    assert sorted(p.name for p in shots.iterdir()) == ["cancelled.png", "cluster.png", "docs.png", "job.png",
                                                        "jobs.png", "nodes.png", "recovered.png", "redoc.png"]


def _failure_and_recovery(cluster: Cluster, page: Any, shots: Path, job: dict[str, Any], data_dir: Path,
                          capsys: pytest.CaptureFixture[str]) -> None:
    """What a person looks for on the job's page when a worker dies (issue 26): the failed attempt
    with its cause, then the recovery and the step it resumed from, with no error in the console."""
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    cluster.wait_for("a committed checkpoint", lambda: cluster.get(
        f"/v1/jobs/{job['id']}/checkpoints", params={"state": "committed"})["items"], 120)
    code, _, err = _cli(["dev", "node", "kill-workers", "node-2", "--data-dir", str(data_dir)], capsys)
    assert code == 0, err
    cluster.wait_for("the second attempt training", lambda: [
        a for a in cluster.get(f"/v1/jobs/{job['id']}/attempts")["items"]
        if a["number"] == 2 and a["progress_step"] is not None], 180)
    page.goto(f"{cluster.url}/ui/jobs/{job['id']}")
    items = page.locator("ol.timeline > li")
    wait_for(lambda: items.count() >= 2, 30, what="two attempts on the job's page")
    texts = [items.nth(i).inner_text() for i in range(items.count())]
    first = next(t for t in texts if t.startswith("#1"))  # #2's text names #1 too ("recovery from #1")
    second = next(t for t in texts if t.startswith("#2"))
    assert "failed" in first and "[signal] rank" in first, first  # the cause, as it was
    assert "restored step" in second and "recovery from #1" in second, second  # where it resumed
    page.screenshot(path=str(shots / "recovered.png"), full_page=True)
    assert errors == [], errors


def _api_pages(cluster: Cluster, page: Any, shots: Path) -> None:
    """/docs and /redoc as a person meets them (the dashboard's "API" link): every operation of the
    served document is listed, and the page logs no error (Swagger UI 4 could not read OpenAPI 3.1
    and showed "Unable to render this definition")."""
    document = cluster.get("/openapi.json")
    operations = sum(1 for item in document["paths"].values() for method in item
                     if method in ("get", "put", "post", "delete", "patch"))
    errors: list[str] = []
    page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(f"{cluster.url}/docs")
    page.locator(".opblock").first.wait_for(timeout=30_000)
    assert page.locator(".opblock").count() == operations, (page.locator(".opblock").count(), operations)
    assert "Unable to render" not in page.content() and page.locator(".errors-wrapper").count() == 0
    assert page.locator(".opblock-summary-path[data-path='/v1/jobs']").count() >= 2  # list and submit
    page.screenshot(path=str(shots / "docs.png"))
    page.goto(f"{cluster.url}/redoc")
    page.locator("[data-section-id^='operation/']").first.wait_for(state="attached", timeout=30_000)
    assert page.locator("[data-section-id^='operation/']").count() == operations
    page.screenshot(path=str(shots / "redoc.png"))
    assert errors == [], errors
