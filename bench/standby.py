"""Warm standbys (issue 14): time from a rank's launch to its training script's first line and to
``import torch`` done, cold against warm standbys, in one run.

Two launches, each measured cold (the rank shim starts a new interpreter) and warm (the shim hands
the rank to a standby of node_agent/ranks/standby_pool.py that imported torch beforehand):
- ``shim``: one rank shim, as torchrun starts it for a rank (from its exec to the script's lines);
- ``torchrun``: ``torchrun --nproc-per-node 2`` with the shim, from its start to the last rank's
  line (torchrun's own start, which imports torch, is in both).
The script's first line records the time, then it imports torch and records it again. Standbys are
refilled and warm before each warm round (outside the timed span: the agent keeps them ready);
rounds alternate cold and warm. Medians of ``--repeat`` rounds.

    flock /tmp/trainyard-heavy.lock .venv/bin/python bench/standby.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from node_agent.part.commands import NodeContext, node_env, standby_env  # noqa: E402
from node_agent.ranks.standby_pool import StandbyPool  # noqa: E402
from trainyard.protocol.env import ENV_JOB_ENV, ENV_STANDBY_DIR, ENV_STATUS_DIR  # noqa: E402

SCRIPT = """\
import time
first = time.time()
import json, os
import torch
done = time.time()
with open(os.path.join(os.environ["BENCH_OUT"], f"rank-{os.environ.get('RANK', '0')}.json"), "w") as f:
    json.dump({"first": first, "torch": done}, f)
"""


def _wait_warm(pool: StandbyPool, count: int) -> None:
    deadline = time.monotonic() + 120
    while True:
        pool.refill()  # as the agent's supervise loop does, every pass
        if pool.warm >= count:
            return
        if time.monotonic() > deadline or pool.disabled:
            raise SystemExit(f"standbys did not get warm ({pool.disabled or 'timeout'})")
        time.sleep(0.05)


def _launch(mode: str, work: Path, env: dict[str, str], standby_dir: Path | None) -> tuple[float, float]:
    out = Path(tempfile.mkdtemp(dir=work))
    env = {**env, ENV_STATUS_DIR: str(out / "status"), ENV_JOB_ENV: json.dumps({"BENCH_OUT": str(out)})}
    if standby_dir is not None:
        env[ENV_STANDBY_DIR] = str(standby_dir)
    shim = ["-m", "node_agent.ranks.shim", "file", str(work / "script.py")]
    if mode == "shim":
        command = [sys.executable, *shim]
        env.update(RANK="0", LOCAL_RANK="0", OMP_NUM_THREADS="1", TORCH_NCCL_ASYNC_ERROR_HANDLING="1")
        ranks = 1
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *shim]
        ranks = 2
    start = time.time()
    done = subprocess.run(command, env=env, cwd=work, capture_output=True, timeout=300, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{mode} launch failed: {done.stderr.decode(errors='replace')[-2000:]}")
    seen = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(ranks)]
    status = [json.loads(p.read_text()) for p in (out / "status").glob("rank-*.json")]
    if standby_dir is not None and not all(s.get("standby") for s in status):
        raise SystemExit(f"a warm {mode} launch started cold: {done.stderr.decode(errors='replace')[-2000:]}")
    return max(s["first"] for s in seen) - start, max(s["torch"] for s in seen) - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-standby-") as tmp:
        work = Path(tmp)
        (work / "script.py").write_text(SCRIPT)
        node = NodeContext(local_addr="127.0.0.1", agent_url="http://agent", virtual=True, cwd=str(work))
        env = node_env(node)
        pool = StandbyPool(size=2, directory=work / "standbys", python=sys.executable, env=standby_env(node),
                           cwd="/")
        times: dict[tuple[str, str], list[tuple[float, float]]] = {}
        try:
            for _ in range(args.repeat):
                for mode in ("shim", "torchrun"):
                    times.setdefault((mode, "cold"), []).append(_launch(mode, work, env, None))
                    _wait_warm(pool, 2)
                    times.setdefault((mode, "warm"), []).append(_launch(mode, work, env, pool.directory))
        finally:
            pool.close()
    print(f"launch -> training script (medians of {args.repeat}; 2-rank torchrun on CPU, torch {_torch()})\n")
    print("| launch | measured to | cold | warm standby | ratio |")
    print("| --- | --- | --- | --- | --- |")
    for mode in ("shim", "torchrun"):
        for index, what in ((0, "first line"), (1, "`import torch` done")):
            cold = statistics.median(t[index] for t in times[(mode, "cold")])
            warm = statistics.median(t[index] for t in times[(mode, "warm")])
            print(f"| {mode} | {what} | {cold:.2f} s | {warm:.2f} s | {warm / cold:.2f} |")


def _torch() -> str:
    import torch

    return torch.__version__


if __name__ == "__main__":
    main()
