"""A complete Trainyard job: a small MLP learns a noisy linear map from synthetic data, with DDP.

    python examples/train_minimal.py --steps 200                        # one process, no cluster
    torchrun --nproc-per-node 2 examples/train_minimal.py --steps 200   # plain torchrun
    trainyard run examples/minimal.yaml -f                              # on a Trainyard cluster

docs/writing-jobs.md walks through it. The platform code is the TrainLoop lines: it restores the
newest checkpoint, saves every `checkpoint.interval_steps`, reports progress and the result, and
stops cleanly. Killed and resumed, the job ends with exactly the weights of a run that never
stopped: the data comes from a map-style dataset through `loop.data_loader`, whose position is in
the checkpoint, and everything else that changes is registered.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

from worker_runtime import TrainLoop, weights_sha256


class NoisyLinear(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """``size`` samples of y = x @ w + noise, drawn once from ``seed``: a map-style dataset."""

    def __init__(self, size: int, dim: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(size, dim, generator=generator)
        w = torch.randn(dim, 1, generator=generator)
        self.y = self.x @ w + 0.1 * torch.randn(size, 1, generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=16, help="Samples per rank per step.")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--step-time-s", type=float, default=0.0,
                        help="Pad each step to this long: to watch it run, and kill a worker by hand.")
    args = parser.parse_args()

    with TrainLoop(total_steps=args.steps, seed=args.seed) as loop:
        torch.manual_seed(args.seed)  # the same initial weights on every rank
        model = loop.register("model", nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1)).to(loop.device))
        optimizer = loop.register("optimizer", torch.optim.AdamW(model.parameters(), lr=args.lr))
        schedule = loop.register("schedule", torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, args.steps))
        dataset = NoisyLinear(args.samples, 32, args.seed)
        data = loop.data_loader(dataset, batch_size=args.batch_size)
        net = loop.ddp(model, dataset[0][0].unsqueeze(0))

        for step, (x, y) in loop.steps(data):
            started = time.monotonic()
            loss = F.mse_loss(net(x.to(loop.device)), y.to(loop.device))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
            loop.log(loss=loss, lr=schedule.get_last_lr()[0])
            if step % 100 == 0 and loop.ctx.rank == 0:  # a line in the job's log now and then
                print(f"step {step} loss {loss.item():.4f}", flush=True)
            time.sleep(max(0.0, args.step_time_s - (time.monotonic() - started)))

        loop.result(weights_sha256=weights_sha256(model), restored_from_step=loop.restored_step)
        del net  # DDP before the process group (the loop destroys it on the way out)


if __name__ == "__main__":
    main()
