"""Exact resume under real agents of a training script a newcomer writes from docs/writing-jobs.md
(issue 24): the kill-point matrix of tests/worker_runtime/test_exact_resume.py, on a live cluster
(the control plane, 3 agents with 2 CPU slots each, torchrun, S3 behind a proxy the test can break).

The script (TRAIN, written into the test's tmp dir and shipped as the job's ``workdir`` by
``trainyard run job.yaml``, as the guide does) trains a small classifier with its own map-style
Dataset through ``loop.data_loader(..., num_workers=2)`` (random per-sample augmentation in the
DataLoader workers: torch, NumPy and Python draws), shuffled over several epochs, ``nn.Dropout``, a
``BatchNorm1d``, SGD with momentum and ``StepLR``, all registered; DDP on 2 nodes x 1 GPU slot.
Rank 0 prints ``step N loss X`` (``repr`` of the float: exact) every step; its result holds the
losses of its attempt and ``weights_sha256``.

64 samples, 4 a rank a step on 2 ranks: an epoch is 8 steps (boundaries after steps 8, 16, 24);
a checkpoint every 6 steps (6, 12, 18, 24, 30), 30 steps in all. One unbroken reference job (run
beside the other), and ONE job killed 4 times (5 attempts), a worker SIGKILLed at each kill point:

1. mid-epoch: checkpoint 6 committed and rank 0 past step 9 (epoch 2 half read, no save pending)
   -> the next attempt restores step 6 and replays across the boundary after step 8;
2. at an epoch boundary: as rank 0 ends step 16, the last of epoch 2 (checkpoint 12 committed)
   -> restores step 12;
3. between a save's start and its commit: S3 blackholed (the proxy holds every connection, no byte
   through) before the save of step 18; the worker killed once both ranks hold an upload slot for
   their shard of 18 (their uploads hang) and rank 0 is past step 18; S3 healed -> restores step
   12, the one before;
4. just after a commit: the moment checkpoint 24 (an epoch boundary: the position saved at the end
   of epoch 3) shows committed -> restores step 24; the last attempt runs to step 30.

The kills are placed by watching rank 0's log file on its node (no shipping delay); where each
landed is checked afterwards from the logs API, so a machine too slow to hit a point fails the test
rather than passing on another case. After each resume the attempt's ``restored_from_step`` is the
expected checkpoint; every step's loss that rank 0 printed in every attempt (read per attempt
through the logs API) equals the reference's at that step (float equality), and the final weights'
sha256 equals the reference's. A kill blames its node (2 blames and the job avoids it), so there
are 3 nodes and each kill picks the rank on the least blamed one.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.harness import LiveCluster
from trainyard.cli import main

pytestmark = [pytest.mark.e2e, pytest.mark.standbys]  # recoveries: later attempts fork warm (tests/conftest.py)
ENDED = {"succeeded", "failed", "cancelled"}
STEPS, INTERVAL, STEP_TIME_S = 30, 6, 0.2

TRAIN = '''\
"""My classifier: which side of a line a point lies on, with augmentation, dropout and BatchNorm."""

import argparse
import random
import time

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

from worker_runtime import TrainLoop, weights_sha256


class Points(Dataset):
    """64 points in 8 dimensions, the same on every run (drawn from a fixed seed)."""

    def __init__(self, size=64, seed=123):
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(size, 8, generator=generator)
        self.y = (self.x[:, 0] - self.x[:, 1] > 0).long()

    def __len__(self):
        return len(self.x)

    def __getitem__(self, index):
        x = self.x[index].clone()
        if torch.rand(()) < 0.5:  # augmentation: the last features reversed, some noise
            x[2:] = x[2:].flip(0)
        x = x + 0.1 * torch.randn_like(x) + float(np.random.uniform(-0.05, 0.05)) + random.gauss(0, 0.01)
        return x, self.y[index]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--step-time-s", type=float, default=0.0)
    args = parser.parse_args()

    with TrainLoop(total_steps=args.steps, seed=7) as loop:
        torch.manual_seed(0)  # the same initial weights on every rank
        model = loop.register("model", nn.Sequential(
            nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 2)).to(loop.device))
        optimizer = loop.register("optimizer", torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        schedule = loop.register("schedule", torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.7))
        dataset = Points()
        data = loop.data_loader(dataset, batch_size=4, num_workers=2)
        net = loop.ddp(model, dataset.x[:4].to(loop.device))
        losses = {}
        for step, (x, y) in loop.steps(data):
            loss = F.cross_entropy(net(x.to(loop.device)), y.to(loop.device))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
            loop.log(loss=loss, lr=schedule.get_last_lr()[0])
            losses[step] = loss.item()
            if loop.ctx.rank == 0:
                print(f"step {step} loss {loss.item()!r}", flush=True)
            time.sleep(args.step_time_s)
        loop.result(weights_sha256=weights_sha256(model), restored_from_step=loop.restored_step, losses=losses)
        del net


if __name__ == "__main__":
    main()
'''

JOB = """\
name: {name}
workdir: .
entrypoint: train.py
args: ["--steps", "{steps}", "--step-time-s", "{step_time}"]
num_nodes: 2
gpus_per_node: 1
checkpoint:
  interval_steps: {interval}
max_failures: 6
"""
STEP_LINE = re.compile(r"^step (\d+) loss (\S+)$")


def _submit(cluster: LiveCluster, job_file: Path, capsys: pytest.CaptureFixture[str]) -> str:
    """``trainyard run JOB_FILE``: ships the workdir, submits, prints the job's id."""
    token = job_file.parent.parent / "token"
    token.write_text(cluster.token)
    with pytest.raises(SystemExit) as done:
        main(["run", str(job_file), "--url", cluster.url, "--token-file", str(token)])
    out, err = capsys.readouterr()
    assert not done.value.code, err
    return out.split()[-1]


def _steps(text: str) -> dict[int, float]:
    found = {}
    for line in text.splitlines():
        if m := STEP_LINE.match(line.strip()):
            found[int(m[1])] = float(m[2])
    return found


def _logged(cluster: LiveCluster, job_id: str, attempt: int | None = None) -> dict[int, float]:
    """The steps and losses rank 0 printed (in ``attempt``), read through the logs API."""
    r = cluster.http.get(f"/v1/jobs/{job_id}/logs", params={"rank": 0, "stream": "stdout", "prefix": False,
                                                            **({"attempt": attempt} if attempt else {})})
    r.raise_for_status()
    return _steps(r.text)


class Attempt:
    """One attempt of the killed job, watched through rank 0's log file on its node (the file the
    agent ships: read here without the shipping delay, so that the test kills at a chosen step)."""

    def __init__(self, cluster: LiveCluster, job_id: str, number: int) -> None:
        self.cluster, self.job_id, self.number = cluster, job_id, number
        self.view = cluster.wait_for(f"attempt {number} of {job_id} running both ranks", self._running, timeout=300,
                                     every=0.1)
        self._log: Path | None = None
        self._printed: dict[int, float] = {}

    def _running(self) -> dict[str, Any] | None:
        items = self.cluster.attempts(self.job_id)
        if len(items) < self.number:
            return None
        view = items[self.number - 1]
        workers = [w for n in view["nodes"] for w in n["workers"] if w["pid"] and w["state"] == "running"]
        return view if len(workers) == 2 else None

    def last_step(self) -> int:
        if self._log is None:
            name = f"{self.view['id']}.0"  # the worker directory of node rank 0, which runs rank 0
            found = [p for root in self.cluster.dev.worker_dirs if root.is_dir()
                     for p in root.glob(f"**/{name}/logs/rank-0/stdout.log")]
            self._log = found[0] if found else None
        if self._log is not None:
            # Once the attempt ended, its agent removes the worker directory: the last read stays.
            with contextlib.suppress(FileNotFoundError):
                self._printed = _steps(self._log.read_text(errors="replace"))
        return max(self._printed, default=0)

    def wait_step(self, step: int, also: Callable[[], bool] = lambda: True) -> int:
        """Wait until rank 0 has printed ``step`` (and ``also``); the step it has printed."""
        return int(self.cluster.wait_for(f"attempt {self.number}: rank 0 past step {step}",
                                         lambda: self.last_step() >= step and also() and self.last_step(),
                                         timeout=300, every=0.03))

    def kill(self, blamed: dict[str, int]) -> None:
        """SIGKILL the rank on the node blamed least so far (two blames and the job avoids a node)."""
        ranks = {w["rank"]: (n["node_name"], w["pid"]) for n in self.view["nodes"] for w in n["workers"]}
        rank = min(ranks, key=lambda r: (blamed.get(ranks[r][0], 0), -r))
        os.kill(ranks[rank][1], signal.SIGKILL)
        view = self.cluster.wait_for(f"attempt {self.number} failed", lambda: (
            v := self.cluster.attempts(self.job_id)[self.number - 1])["outcome"] and v, timeout=120)
        assert view["outcome"] == "failed" and "-9" in (view["end_reason"] or ""), view
        if view["failed_node"]:
            blamed[view["failed_node"]] = blamed.get(view["failed_node"], 0) + 1


def _committed(cluster: LiveCluster, job_id: str, step: int, attempt: int) -> bool:
    return any(c["step"] == step and c["attempt_number"] == attempt
               for c in cluster.checkpoints(job_id, "committed"))


@pytest.mark.timeout(900)  # 6 cold starts of torch: minutes on a loaded 2-core machine
def test_a_users_job_killed_at_every_kill_point_resumes_exactly(
    make_cluster: Callable[..., LiveCluster], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    started = time.monotonic()
    # 2 slots a node: the reference runs beside the killed job (on this 2-core machine, the cold
    # starts of 6 attempts are most of the time).
    cluster = make_cluster(nodes=3, gpus_per_node=2, proxy_s3=True)
    assert cluster.s3_proxy is not None and cluster.dev.tls is not None
    monkeypatch.setenv("TRAINYARD_CA_FILE", str(cluster.dev.tls.ca_file))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the CLI's code cache
    code = tmp_path / "myjob"
    code.mkdir()
    (code / "train.py").write_text(TRAIN)
    for name, step_time in (("reference", 0), ("killed", STEP_TIME_S)):  # the step time changes no number
        (code / f"{name}.yaml").write_text(JOB.format(name=name, steps=STEPS, step_time=step_time,
                                                      interval=INTERVAL))
    reference_id = _submit(cluster, code / "reference.yaml", capsys)
    job_id = _submit(cluster, code / "killed.yaml", capsys)
    blamed: dict[str, int] = {}

    # 1. Mid-epoch: checkpoint 6 committed, rank 0 in epoch 2 (steps 9-16), before the save of 12.
    first = Attempt(cluster, job_id, 1)
    first.wait_step(9, also=lambda: _committed(cluster, job_id, 6, 1))
    first.kill(blamed)

    # 2. At an epoch boundary: as rank 0 ends step 16, the last of epoch 2.
    second = Attempt(cluster, job_id, 2)
    second.wait_step(16, also=lambda: _committed(cluster, job_id, 12, 2))
    second.kill(blamed)

    # 3. Between a save's start and its commit: no byte reaches S3 from before the save of 18 until
    # after the kill. Rank 0 past step 18 means both ranks started that save (under DDP rank 0
    # cannot finish step 19 alone), and its upload hangs.
    third = Attempt(cluster, job_id, 3)
    assert third.wait_step(13) < 18, "attempt 3 was past step 18 before S3 could be cut"
    cluster.s3_proxy.blackhole()
    try:
        # Each rank took an upload slot for its shard of 18: its upload is under way (and hangs).
        third.wait_step(19, also=lambda: {s["rank"] for s in cluster.get("/v1/upload-slots", params={
            "job_id": job_id})["slots"] if s["attempt_id"] == third.view["id"] and s["step"] == 18
            and s["granted_at"]} == {0, 1})
        assert not _committed(cluster, job_id, 18, 3)
        third.kill(blamed)
    finally:
        cluster.s3_proxy.heal()

    # 4. Just after a commit: checkpoint 24, taken at the end of epoch 3.
    fourth = Attempt(cluster, job_id, 4)
    fourth.wait_step(24, also=lambda: _committed(cluster, job_id, 24, 4))
    fourth.kill(blamed)

    done = cluster.wait_state(job_id, ENDED, timeout=300)
    assert done["state"] == "succeeded", done["end_reason"]
    reference = cluster.wait_state(reference_id, ENDED, timeout=300)
    assert reference["state"] == "succeeded", reference["end_reason"]
    assert len(cluster.attempts(reference_id)) == 1
    expected = {int(s): v for s, v in reference["result"]["losses"].items()}
    assert sorted(expected) == list(range(1, STEPS + 1))
    assert _logged(cluster, reference_id) == expected  # its log says what it computed
    attempts = cluster.wait_for("every attempt ended (its last log lines shipped)", lambda: (
        a := cluster.attempts(job_id)) and all(x["state"] == "ended" for x in a) and a, timeout=120)
    assert [a["outcome"] for a in attempts] == ["failed"] * 4 + ["succeeded"], [
        (a["number"], a["outcome"], a["end_reason"], a["restored_from_step"]) for a in attempts]
    # Each attempt's log through the API: all that rank 0 printed (at least what this test saw).
    seen = {a.number: a.last_step() for a in (first, second, third, fourth)}
    printed = {a["number"]: cluster.wait_for(f"attempt {a['number']}'s log", lambda n=a["number"]: (
        p := _logged(cluster, job_id, n)) and max(p) >= seen.get(n, STEPS) and p, timeout=60) for a in attempts}
    last = [max(printed[n]) for n in (1, 2, 3, 4)]
    # Where the kills landed (rank 0's last step): a kill the machine was too slow to place fails here.
    assert 9 <= last[0] < 12, f"kill 1 meant for mid-epoch 2, before the save of 12: {last}"
    assert 16 <= last[1] < 18, f"kill 2 meant for the boundary after step 16: {last}"
    assert 19 <= last[2] < 24, f"kill 3 meant for while the save of 18 was pending: {last}"
    assert 24 <= last[3] < STEPS, f"kill 4 meant for just after the commit of 24: {last}"
    restored = [a["restored_from_step"] for a in attempts]
    assert restored == [None, 6, 12, 12, 24], (restored, last)
    assert done["result"]["restored_from_step"] == 24
    assert not [c for c in cluster.checkpoints(job_id, "committed") if c["step"] == 18 and c["attempt_number"] == 3]

    # Every step's loss, in every attempt, from its resume point on: the reference's, bit for bit.
    for number, start in enumerate(restored, start=1):
        steps = sorted(printed[number])
        assert steps == list(range((start or 0) + 1, steps[-1] + 1)), (number, steps)
        assert printed[number] == {s: expected[s] for s in steps}, f"attempt {number}, resumed after step {start}"
    assert {int(s): v for s, v in done["result"]["losses"].items()} == {s: expected[s] for s in range(25, STEPS + 1)}
    assert done["result"]["weights_sha256"] == reference["result"]["weights_sha256"]
    # Written as the guide says, the script registers everything a resume needs: no warning.
    assert [e for j in (job_id, reference_id) for e in cluster.events(j, "worker.resume.inexact")] == []
    print(f"rank 0's last step in each killed attempt: {last}; blamed: {blamed}; "
          f"{time.monotonic() - started:.1f}s in all")
