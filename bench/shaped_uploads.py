"""Checkpoint uploads through one shaped rack uplink, with and without upload slots (issue 29): the
step time of a training job that shares the uplink, and how long each checkpoint's burst takes.

    flock /tmp/trainyard-heavy.lock .venv/bin/python bench/shaped_uploads.py        # root only
    .venv/bin/python bench/shaped_uploads.py --uplink 100mbit --saves 3

A real dev cluster on real links (``trainyard dev up --netns``: trainyard/dev/netns.py): three nodes
of two virtual GPUs, node-1 and node-2 in rack r1 and node-3 in rack r2, node links at
``--node-link``, each rack's uplink at ``--uplink`` (tc tbf both ways); the control plane,
PostgreSQL and S3 on the host side, which rack r1 reaches only through its uplink.

- The **trainer**, tiny_gpt with DDP on node-1 and node-3 (node-2 cordoned while it is placed): its
  gradients cross r1's uplink every step.
- The **checkpointer**, tiny_gpt on node-1 and node-2 (rack-aware placement keeps it in r1), saving
  every ``--every`` steps: each save sends both ranks' shards to S3 through the same uplink.

Configurations (a fresh cluster each): no limits (the defaults); one upload in flight per rack
(``TRAINYARD_UPLOAD_SLOTS_PER_LABEL=1``) with a byte budget per node of a quarter of the uplink
(``TRAINYARD_UPLOAD_NODE_RATE_BYTES_PER_S``). Printed per configuration: the trainer's step time
(the worker's own ``step_s``, one progress report per step) while no save runs and while one does (the
windows are the checkpoints' created_at -> committed_at), their ratio, each burst's time from the
checkpoint's start to its commit, the checkpointer's slot waits as the control plane recorded
them, and how busy the machine's cores were while the checkpointer ran (psutil, all processes): the
uplink, not the 2 cores, must be what the trainer waits for.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.handover import wait_for  # noqa: E402
from trainyard.dev import DevCluster, DevConfig  # noqa: E402
from trainyard.dev.netns import Shape, Topology, parse_rate  # noqa: E402
from trainyard.embedded import free_port  # noqa: E402

TINY = "worker_runtime.examples.tiny_gpt"


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _ts(text: str) -> float:
    return datetime.fromisoformat(text).timestamp()


def _running_on(http: httpx.Client, job_id: str) -> list[str] | None:
    view = http.get(f"/v1/jobs/{job_id}").raise_for_status().json()
    if view["state"] in ("failed", "cancelled", "succeeded"):
        raise RuntimeError(f"job {job_id} ended {view['state']}: {view['end_reason']}")
    if view["state"] != "running":
        return None
    attempts = http.get(f"/v1/jobs/{job_id}/attempts").raise_for_status().json()["items"]
    return sorted(n["node_name"] for n in attempts[-1]["nodes"])


def run_config(name: str, env: dict[str, str], args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    topology = Topology(racks=2, node_link=Shape(rate_bits=parse_rate(args.node_link)),
                        rack_uplink=Shape(rate_bits=parse_rate(args.uplink)))
    config = DevConfig(nodes=3, gpus_per_node=2, port=free_port(), data_dir=workdir / name.replace(" ", "-"),
                       network=topology, control_plane_env=env)
    log = (workdir / f"{name.replace(' ', '-')}.log").open("w")
    dev = DevCluster(config, log)
    try:
        dev.start()
        http = httpx.Client(base_url=config.api_url, headers={"Authorization": f"Bearer {dev.token}"}, timeout=30,
                            verify=dev.verify)
        nodes = {n["name"]: n["id"] for n in http.get("/v1/nodes").raise_for_status().json()}
        http.post(f"/v1/nodes/{nodes['node-2']}/cordon").raise_for_status()
        trainer = http.post("/v1/jobs", json={
            "name": "trainer", "num_nodes": 2, "gpus_per_node": 1, "entrypoint": TINY,
            # --log-every 1: each progress sample's step_s is one step's, not a mean over ten.
            "args": ["--steps", "100000", "--d-model", str(args.trainer_d_model), "--layers", "2", "--log-every", "1"],
        }).raise_for_status().json()
        placed = wait_for("the trainer running", lambda: _running_on(http, trainer["id"]), 180)
        if placed != ["node-1", "node-3"]:
            raise RuntimeError(f"the trainer runs on {placed}, not across the racks")
        http.post(f"/v1/nodes/{nodes['node-2']}/uncordon").raise_for_status()
        steps = args.every * (args.saves + 1)
        saver = http.post("/v1/jobs", json={
            "name": "checkpointer", "num_nodes": 2, "gpus_per_node": 1, "entrypoint": TINY,
            "args": ["--steps", str(steps), "--step-delay-s", str(args.step_delay_s),
                     "--d-model", str(args.d_model), "--layers", "4"],
            "checkpoint": {"interval_steps": args.every, "keep_last": 100}}).raise_for_status().json()
        placed = wait_for("the checkpointer running", lambda: _running_on(http, saver["id"]), 180)
        if placed != ["node-1", "node-2"]:
            raise RuntimeError(f"the checkpointer runs on {placed}, not inside rack r1")
        say(f"{name}: trainer on node-1 + node-3, checkpointer on node-1 + node-2")
        cpu_before = psutil.cpu_times()
        view = wait_for("the checkpointer done", lambda: (v := http.get(f"/v1/jobs/{saver['id']}").json())["state"]
                     in ("succeeded", "failed", "cancelled") and v, timeout=900)
        cpu_after = psutil.cpu_times()
        if view["state"] != "succeeded":
            raise RuntimeError(f"the checkpointer ended {view['state']}: {view['end_reason']}")
        checkpoints = [c for c in http.get(f"/v1/jobs/{saver['id']}/checkpoints").json()["items"]
                       if c["state"] == "committed"]
        samples: list[dict[str, Any]] = []
        cursor = None
        while True:
            page = http.get(f"/v1/jobs/{trainer['id']}/progress", params={"limit": 1000, **(
                {"cursor": cursor} if cursor else {})}).raise_for_status().json()
            samples += page["items"]
            if not (cursor := page["next_cursor"]):
                break
        http.post(f"/v1/jobs/{trainer['id']}/cancel")
        http.close()
    finally:
        dev.stop()
        log.close()
    if not checkpoints:
        raise RuntimeError(f"{name}: the checkpointer committed no checkpoint")
    bursts = [(_ts(c["created_at"]), _ts(c["committed_at"])) for c in checkpoints]
    start, end = min(b[0] for b in bursts), max(b[1] for b in bursts)
    during: list[float] = []
    quiet: list[float] = []
    for s in samples:
        step_s = s["metrics"].get("step_s")
        if step_s is None:
            continue
        at = _ts(s["at"]) - step_s / 2  # the middle of the step it measured
        if at < start - 30 or at > end + 5:
            continue
        (during if any(a <= at <= b for a, b in bursts) else quiet).append(step_s)
    waits = [c["upload"]["wait_s_max"] for c in checkpoints if c.get("upload")]
    total = sum(cpu_after) - sum(cpu_before)
    idle = (cpu_after.idle + cpu_after.iowait) - (cpu_before.idle + cpu_before.iowait)
    return {"name": name, "bursts": [b - a for a, b in bursts], "during": during, "quiet": quiet,
            "busy": (total - idle) / total if total > 0 else 0.0,
            "size": statistics.median(c["size_bytes"] for c in checkpoints), "waits": waits}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--node-link", default="1gbit")
    parser.add_argument("--uplink", default="100mbit", help="each rack's uplink")
    parser.add_argument("--saves", type=int, default=3, help="the checkpointer's saves before its last step's")
    parser.add_argument("--every", type=int, default=40, help="the checkpointer's steps between saves")
    parser.add_argument("--step-delay-s", type=float, default=0.1, help="the checkpointer's pause per step")
    parser.add_argument("--d-model", type=int, default=256, help="the checkpointer's model width (its shard size)")
    parser.add_argument("--trainer-d-model", type=int, default=256, help="the trainer's (its gradients' size)")
    args = parser.parse_args()
    quarter = parse_rate(args.uplink) // 8 // 4
    configs = {
        "no limits": {},
        "slots": {"TRAINYARD_UPLOAD_SLOTS_PER_LABEL": "1", "TRAINYARD_UPLOAD_NODE_RATE_BYTES_PER_S": str(quarter)},
    }
    started = time.monotonic()
    results = []
    with tempfile.TemporaryDirectory(prefix="trainyard-shaped-uploads-") as tmp:
        for name, env in configs.items():
            results.append(run_config(name, env, args, Path(tmp)))
            say(f"{name} done ({time.monotonic() - started:.0f} s)")
    print(f"\nrack uplink {args.uplink} (node links {args.node_link}); the checkpointer's {len(results[0]['bursts'])} "
          f"checkpoints of "
          f"{results[0]['size'] / 1e6:.1f} MB each; slots: 1 upload per rack, {quarter / 1e6:.2f} MB/s per node\n")
    print("| configuration | trainer step, no save running | during a save | ratio | burst, start -> commit "
          "| slot wait, longest | CPU busy |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        quiet = statistics.median(r["quiet"]) if r["quiet"] else float("nan")
        during = statistics.median(r["during"]) if r["during"] else float("nan")
        bursts = ", ".join(f"{b:.1f}" for b in r["bursts"])
        waits = ", ".join(f"{w:.1f}" for w in r["waits"]) or "-"
        print(f"| {r['name']} | {quiet * 1e3:.0f} ms (n={len(r['quiet'])}) | {during * 1e3:.0f} ms "
              f"(n={len(r['during'])}) | {during / quiet:.2f} | {bursts} s | {waits} s | {r['busy']:.0%} |")
    print(f"\n{time.monotonic() - started:.0f} s in all", file=sys.stderr)


if __name__ == "__main__":
    main()
