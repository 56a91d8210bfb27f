"""A plain torchrun script that checkpoints with ``torch.distributed.checkpoint`` on its own (no
worker_runtime), written as a user would, runs unchanged on a real dev cluster (issue 24): it is
shipped with its job's code, torchrun starts it on both nodes, its DCP saves work, and when one
node's rank is SIGKILLed the next attempt starts it again from scratch and it ends with the weights
of a run that never broke. What Trainyard guarantees for such a script, and what it does not
(it does not restore the script's checkpoints: the next attempt is another uid in another worker
directory), is docs/writing-jobs.md's "A plain torchrun script with its own checkpoints"."""

from __future__ import annotations

import hashlib
import json
import os
import signal
from pathlib import Path

import pytest

from trainyard.cli.code_ship import pack

pytestmark = [pytest.mark.e2e, pytest.mark.standbys]  # recoveries: later attempts fork warm (tests/conftest.py)
ENDED = {"succeeded", "failed", "cancelled"}
STEPS = 40

# The user's script: torch only. It looks for its newest checkpoint where it saves them (its working
# directory), resumes from it when there is one, and prints the sha256 of its final weights.
SCRIPT = '''
import hashlib, json, os, sys, time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel

steps, delay = int(sys.argv[1]), float(sys.argv[2])
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
net = DistributedDataParallel(model)
optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)

start = 0
saved = sorted(int(name.split("_")[1]) for name in os.listdir("checkpoints")) if os.path.isdir("checkpoints") else []
if saved:
    start = saved[-1]
    model_state, optimizer_state = get_state_dict(net, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=f"checkpoints/step_{start}")
    set_state_dict(net, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
print(f"plain-dcp rank {rank}: starting at step {start}", flush=True)

for step in range(start + 1, steps + 1):
    generator = torch.Generator().manual_seed(step * 1000 + rank)
    x = torch.randn(16, 8, generator=generator)
    loss = torch.nn.functional.mse_loss(net(x), x.sum(dim=1, keepdim=True))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    if step % 10 == 0:
        model_state, optimizer_state = get_state_dict(net, optimizer)
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=f"checkpoints/step_{step}")
        print(f"plain-dcp rank {rank}: saved step {step}", flush=True)
    time.sleep(delay)

if rank == 0:
    weights = b"".join(t.detach().contiguous().numpy().tobytes() for t in model.state_dict().values())
    print(json.dumps({"plain_dcp_sha256": hashlib.sha256(weights).hexdigest()}), flush=True)
del net
dist.destroy_process_group()
'''


def _logs(cluster, job_id: str) -> str:
    return cluster.http.get(f"/v1/jobs/{job_id}/logs").text


def _sha(logs: str) -> str:
    lines = [json.loads(line[line.index("{"):]) for line in logs.splitlines() if "plain_dcp_sha256" in line]
    assert len(lines) == 1, logs[-3000:]
    return str(lines[0]["plain_dcp_sha256"])


def _running_rank(cluster, job_id: str, rank: int) -> int | None:
    attempt = cluster.get(f"/v1/jobs/{job_id}/attempts")["items"][-1]
    pids = [w["pid"] for n in attempt["nodes"] for w in n["workers"]
            if w["rank"] == rank and w["pid"] and w["state"] == "running"]
    return pids[0] if pids else None


@pytest.mark.parametrize("cluster", [{"env": {"TRAINYARD_NODE_LOST_TIMEOUT_S": "30"}}], indirect=True)
def test_a_plain_torchrun_script_with_its_own_dcp_checkpoints_runs_unchanged(cluster, tmp_path: Path):
    workdir = tmp_path / "job"
    workdir.mkdir()
    (workdir / "train.py").write_text(SCRIPT)
    archive = pack(workdir)
    sha256 = hashlib.sha256(archive).hexdigest()
    put = cluster.http.put(f"/v1/code/{sha256}", content=archive)
    assert put.status_code in (200, 201), put.text
    body = {"num_nodes": 2, "gpus_per_node": 1, "entrypoint": "train.py", "args": [str(STEPS), "0.1"],
            "code": {"sha256": sha256}, "max_failures": 2}
    clean = cluster.submit({**body, "name": "plain-clean"})
    job = cluster.submit({**body, "name": "plain-killed"})

    cluster.wait_for("the script's first DCP save on both ranks", lambda: all(
        f"plain-dcp rank {r}: saved step 10" in _logs(cluster, job["id"]) for r in (0, 1)), timeout=150)
    victim = cluster.wait_for("rank 1 running", lambda: _running_rank(cluster, job["id"], 1), timeout=30)
    os.kill(victim, signal.SIGKILL)

    done = cluster.wait_state(clean["id"], ENDED, timeout=180)
    assert done["state"] == "succeeded", done["end_reason"]
    resumed = cluster.wait_state(job["id"], ENDED, timeout=240)
    assert resumed["state"] == "succeeded", resumed["end_reason"]
    attempts = cluster.get(f"/v1/jobs/{job['id']}/attempts")["items"]
    assert [a["outcome"] for a in attempts] == ["failed", "succeeded"], [a["end_reason"] for a in attempts]
    assert attempts[0]["failure_kind"] == "signal", attempts[0]
    # Trainyard restored nothing of the script's (it knows none of its checkpoints) ...
    assert attempts[1]["restored_from_step"] is None
    logs = _logs(cluster, job["id"])
    # ... and the script, started again in a new worker directory, found none of its own: it began at
    # step 0 and saved again, and ended with the weights of the run that never broke.
    assert logs.count("plain-dcp rank 0: starting at step 0") == 2, logs[-3000:]
    assert "plain-dcp rank 1: saved step 40" in logs
    assert _sha(logs) == _sha(_logs(cluster, clean["id"]))
