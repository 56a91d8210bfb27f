"""A restartable job (worker_runtime.run_restartable) for the in-process restart test under real agents:
a small deterministic model trained with DDP; rank 0's result names every rank's pid and how many
times it restarted in process, and the weights' sha256.

    restartable_job.py STEPS STEP_DELAY_S
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

from worker_runtime import run_restartable, weights_sha256


def train(loop: Any) -> None:
    delay = float(sys.argv[2])
    x = torch.randn(256, 8, generator=torch.Generator().manual_seed(7))
    data = TensorDataset(x, x.sum(dim=1, keepdim=True))
    torch.manual_seed(0)
    model = loop.register("model", nn.Linear(8, 1))
    optimizer = loop.register("optimizer", torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    net = loop.ddp(model)
    for _, (xb, yb) in loop.steps(loop.data_loader(data, batch_size=8)):
        loss = F.mse_loss(net(xb), yb)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        loop.log(loss=loss)
        time.sleep(delay)
    ranks: list[Any] = [None] * loop.ctx.world_size
    dist.all_gather_object(ranks, {"rank": loop.ctx.rank, "pid": os.getpid(), "restarts": loop.restarts})
    loop.result(weights_sha256=weights_sha256(model), ranks=ranks, restored=loop.restored_step)


if __name__ == "__main__":
    run_restartable(train, total_steps=int(sys.argv[1]), seed=3, log_every=5, timeout_s=30.0)
