from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from tests.helpers import ProcessReaper
from tests.worker_runtime.fake_agent import serve_fake_agent
from worker_runtime import Reporter, WorkerContext
from worker_runtime.examples.tiny_gpt import Config, Trainer

REPO = Path(__file__).resolve().parents[2]
TINY_GPT_20 = ["worker_runtime.examples.tiny_gpt", "--steps", "20", "--log-every", "5"]
SMALL = Config(steps=12, batch_size=4, seq_len=16, d_model=32, layers=1, heads=2, log_every=4)


def _standalone() -> WorkerContext:
    return WorkerContext(device="cpu")


def test_batches_depend_only_on_step_and_rank() -> None:
    def batch(rank: int, world: int, step: int) -> torch.Tensor:
        trainer = Trainer(SMALL, WorkerContext(device="cpu", rank=rank, world_size=world, local_world_size=world))
        trainer.position.offset = step
        return trainer.batches.next(torch.device("cpu"))[0]

    assert torch.equal(batch(1, 2, 5), batch(1, 2, 5))
    assert not torch.equal(batch(0, 2, 5), batch(1, 2, 5))  # disjoint slices of one global batch
    assert not torch.equal(batch(0, 2, 5), batch(0, 2, 6))
    # One global stream, sliced by (step, rank): rank 1 of 2 at step 0 reads what a single rank
    # reads at step 1.
    assert torch.equal(batch(1, 2, 0), batch(0, 1, 1))


def test_resuming_from_saved_state_is_bit_identical() -> None:
    with Reporter(_standalone(), echo=False) as reporter:
        uninterrupted = Trainer(SMALL, _standalone()).fit(reporter)
        first = Trainer(SMALL, _standalone())
        assert first.fit(reporter, until=5) is not None
        buffer = io.BytesIO()
        torch.save(first.state.state_dict(), buffer)  # what a checkpoint will hold
        buffer.seek(0)
        saved = torch.load(buffer, weights_only=True)
        torch.manual_seed(1234)  # the resumed process starts with other RNG state
        resumed = Trainer(SMALL, _standalone())
        resumed.state.load_state_dict(saved)
        result = resumed.fit(reporter)
    assert uninterrupted is not None and result is not None
    assert result["steps"] == uninterrupted["steps"] == SMALL.steps
    assert result["weights_sha256"] == uninterrupted["weights_sha256"]
    assert result["final_loss"] == uninterrupted["final_loss"]


def _torchrun(reaper: ProcessReaper, module_args: list[str], extra_env: dict[str, str]) -> tuple[dict[str, Any], str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("TRAINYARD_") and k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(
        OMP_NUM_THREADS="1",
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
        **extra_env,
    )
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    args += ["-m", *module_args]
    proc = reaper.spawn(args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, f"torchrun failed ({proc.returncode}):\n{stdout}\n{stderr}"
    [line] = [line for line in stdout.splitlines() if line.startswith("{")]
    return json.loads(line), stdout


def test_torchrun_is_deterministic_and_learns(process_reaper: ProcessReaper) -> None:
    with serve_fake_agent() as agent:
        managed_env = {
            "TRAINYARD_AGENT_URL": agent.url,
            "TRAINYARD_ATTEMPT_ID": "att-7",
            "TRAINYARD_FENCING_TOKEN": "tok-7",
            "TRAINYARD_DEVICE": "cpu",
        }
        first, stdout = _torchrun(process_reaper, TINY_GPT_20, managed_env)
        progress = [r.body for r in agent.of("progress")]
        results = [r.body for r in agent.of("result")]
    second, _ = _torchrun(process_reaper, TINY_GPT_20, {"TRAINYARD_DEVICE": "cpu"})

    assert set(first) >= {"final_loss", "weights_sha256", "steps", "world_size"}
    assert (first["steps"], first["world_size"]) == (20, 2)
    assert first["weights_sha256"] == second["weights_sha256"]
    assert first["final_loss"] < first["initial_loss"] - 0.3, stdout
    # Through the agent: progress from rank 0 only, then rank 0's result, the same as printed.
    assert progress and {p["rank"] for p in progress} == {0} and progress[-1]["step"] == 20
    assert all(p["fencing_token"] == "tok-7" for p in progress)
    assert results == [{"fencing_token": "tok-7", "rank": 0, "result": first}]


def test_ddp_resume_is_bit_identical(process_reaper: ProcessReaper) -> None:
    both, stdout = _torchrun(process_reaper, ["tests.worker_runtime.ddp_resume_worker"], {})
    resumed, uninterrupted = both["resumed"], both["uninterrupted"]
    assert resumed["weights_sha256"] == uninterrupted["weights_sha256"], stdout
    assert resumed["final_loss"] == uninterrupted["final_loss"]
    assert (resumed["steps"], resumed["world_size"]) == (12, 2)
