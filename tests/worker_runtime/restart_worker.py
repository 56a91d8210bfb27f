"""One rank of test_inprocess_restart: a restartable TrainLoop (worker_runtime.run_restartable) over
a fenced rendezvous (TRAINYARD_RENDEZVOUS, RANK, WORLD_SIZE). With DIE_AT_STEP this rank exits
abruptly before that step's work in attempt 1, the first (a crashed rank). Each rank prints one JSON line."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

from worker_runtime import run_restartable, weights_sha256

STEPS = 10


def train(loop: Any) -> dict[str, Any]:
    die_at = int(os.environ.get("DIE_AT_STEP") or 0)
    torch.manual_seed(1000 + loop.ctx.attempt_number + 17 * loop.restarts)  # a restart sees other RNG state
    x = torch.randn(96, 8, generator=torch.Generator().manual_seed(7))
    data = TensorDataset(x, x.sum(dim=1, keepdim=True))
    torch.manual_seed(0)
    model = loop.register("model", nn.Linear(8, 1))
    optimizer = loop.register("optimizer", torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    net = loop.ddp(model)
    for step, (xb, yb) in loop.steps(loop.data_loader(data, batch_size=8)):
        if step == die_at and loop.ctx.attempt_number == 1:
            loop.checkpoints.wait()  # crash once the last save reached storage (the test plans its restore)
            sys.stdout.flush()
            os._exit(3)  # a crash: no cleanup, no goodbye to the peers
        noise = torch.randn(1).item() * 1e-3  # uses the RNG: the restored RNG must be the saved one
        loss = F.mse_loss(net(xb), yb) + noise
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        loop.log(loss=loss)
    return {"sha": weights_sha256(model), "restored": loop.restored_step, "from": loop.restored_from,
            "steps": loop.step, "attempt": loop.ctx.attempt_id, "rank": loop.ctx.rank, "restarts": loop.restarts,
            "pid": os.getpid()}


def main() -> None:
    out = run_restartable(train, total_steps=STEPS, seed=3, log_every=5, timeout_s=90.0, handover_wait_s=90.0)
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
