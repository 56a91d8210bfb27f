"""Peak GPU memory of real training steps, for bench/planner_memory.py to set against the planner.

Needs torch with CUDA and nothing else (it runs as is on a bare GPU machine): a GPT-style model of
the planner's shape (per layer 12 h^2 + 13 h parameters, tied embeddings, SDPA attention), AdamW
(fused) in bf16 mixed precision, under DDP (autocast) and FSDP2 (MixedPrecisionPolicy), with and
without activation checkpointing, on one GPU (world size 1). Writes one JSON document.

    python bench/planner_memory_gpu.py OUT.json                 # every configuration, one process each
    python bench/planner_memory_gpu.py OUT.json fsdp,1 ['{"layers": 24, "micro_batch": 2, ...}']
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint


class Block(nn.Module):
    def __init__(self, h: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Model(nn.Module):
    def __init__(self, a: SimpleNamespace, checkpointing: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(a.vocab, a.hidden)
        self.blocks = nn.ModuleList(Block(a.hidden, a.heads) for _ in range(a.layers))
        self.norm = nn.LayerNorm(a.hidden)
        self.checkpointing = checkpointing

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointing else block(x)
        return F.linear(self.norm(x), self.embed.weight)


def measure(a: SimpleNamespace, layout: str, checkpointing: bool) -> dict[str, object]:
    with torch.device("cuda"):
        model = Model(a, checkpointing)
    params = sum(p.numel() for p in model.parameters())
    built = torch.cuda.memory_allocated()
    wrapped: nn.Module = model
    if layout == "ddp":
        wrapped = nn.parallel.DistributedDataParallel(model)
    else:
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
        for block in model.blocks:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
    wrapped_bytes = torch.cuda.memory_allocated() - built
    optimizer = torch.optim.AdamW(model.parameters(), fused=True)
    ids = torch.randint(0, a.vocab, (a.micro_batch, a.seq_len), device="cuda")
    times, state = [], 0
    for step in range(a.steps):
        torch.cuda.synchronize()
        if step == 1:  # optimizer states exist from here on
            torch.cuda.reset_peak_memory_stats()
            state = torch.cuda.memory_allocated()
        start = time.perf_counter()
        with torch.autocast("cuda", torch.bfloat16, enabled=layout == "ddp"):
            logits = wrapped(ids)
        F.cross_entropy(logits.float().flatten(0, 1), ids.flatten()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    result = {"layout": layout, "checkpointing": checkpointing, "params": params, "built_bytes": built,
              "wrap_bytes": wrapped_bytes, "state_bytes": state,
              "peak_bytes": torch.cuda.max_memory_allocated(), "step_s": sum(times[1:]) / (a.steps - 1)}
    del wrapped, model, optimizer, logits
    gc.collect()
    torch.cuda.empty_cache()
    return result


SHAPE = {"layers": 24, "hidden": 2048, "vocab": 32000, "heads": 16, "seq_len": 2048, "micro_batch": 4, "steps": 4}
CONFIGS = ("ddp,0", "ddp,1", "fsdp,0", "fsdp,1")


def main() -> None:
    """OUT.json [LAYOUT,CHECKPOINTING [SHAPE JSON]]: one configuration in this process; without one,
    each in a process of its own (nothing of a run stays allocated into the next one's figures)."""
    out, config = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None
    if config is None:
        runs = []
        for config in CONFIGS:
            subprocess.run([sys.executable, __file__, out, config], check=True)
            with open(out) as f:
                doc = json.load(f)
            runs += doc["runs"]
        with open(out, "w") as f:
            json.dump({**doc, "runs": runs}, f)
        return
    a = SimpleNamespace(**{**SHAPE, **json.loads(sys.argv[3] if len(sys.argv) > 3 else "{}")})
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29531", rank=0, world_size=1)
    layout, checkpointing = config.split(",")
    runs = [measure(a, layout, checkpointing == "1")]
    dist.destroy_process_group()
    doc = {"shape": vars(a), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "runs": runs}
    json.dump(doc, open(out, "w"))  # noqa: SIM115 (closed at exit; short for a copy sent in a command line)
    print(json.dumps(runs))


if __name__ == "__main__":
    main()
