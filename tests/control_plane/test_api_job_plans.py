"""A job's model block and layout at submit, on a real Postgres: the plan stored and shown with the
job, refusal (422 with the numbers) of a layout that does not fit, a warning event naming the GPU
count that does better, and the layout in the launch spec every node gets."""

from __future__ import annotations

import pytest

from tests.factories import ADMIN, FakeAgentSession, job_body, workers_for

H100 = "NVIDIA H100 80GB HBM3"
# A 1.3B model (shape given), 2k tokens per sample, 2 samples per GPU per micro-step.
MODEL = {"layers": 24, "hidden": 2048, "vocab": 50257, "seq_len": 2048, "micro_batch": 2,
         "activation_checkpointing": True}


@pytest.fixture
def h100s(client):
    """Two 8-GPU H100 nodes."""
    return [FakeAgentSession(client, f"gpu-{i}", 8, kind=H100) for i in range(2)]


def test_a_job_with_a_model_is_planned_and_the_plan_shown_with_it(client, h100s):
    layout = {"kind": "fsdp", "grad_accum_steps": 2}
    r = client.post("/v1/jobs", json=job_body(num_nodes=2, gpus_per_node=8, model=MODEL, layout=layout), headers=ADMIN)
    assert r.status_code == 201, r.text
    job = client.get(f"/v1/jobs/{r.json()['id']}", headers=ADMIN).json()
    assert job["layout"]["kind"] == "fsdp" and job["layout"]["grad_accum_steps"] == 2
    assert job["model"]["layers"] == 24
    plan = job["plan"]
    assert plan["hardware"]["gpu_kind"] == "h100-sxm" and plan["hardware"]["cluster_nodes"] == 2
    row = plan["row"]
    assert row["gpus"] == 16 and row["layout"]["grad_accum_steps"] == 2 and row["micro_batch"] == 2
    assert row["memory"]["fits"] and row["feasible"]
    # The global batch follows from the job: 2 samples x 2 micro-steps x 16 ranks x 2,048 tokens.
    assert plan["model"]["tokens_per_step"] == 2 * 2 * 16 * 2048
    assert [x["gpus"] for x in plan["rows"]] == [1, 2, 4, 8, 16]
    assert plan["warnings"] == []
    kinds = [e["kind"] for e in client.get(f"/v1/jobs/{job['id']}/events", headers=ADMIN).json()["items"]]
    assert kinds == ["job.queued"]
    # A job without a model has no plan and no layout: its workers run plain DDP.
    plain = client.post("/v1/jobs", json=job_body(num_nodes=1), headers=ADMIN).json()
    assert plain["plan"] is None and plain["layout"] is None and plain["model"] is None


def test_a_layout_that_does_not_fit_is_refused_with_the_numbers(client, h100s):
    big = {"params": 30e9, "layers": 48, "hidden": 7168, "seq_len": 4096, "micro_batch": 1,
           "activation_checkpointing": True}
    r = client.post("/v1/jobs", json=job_body(num_nodes=2, gpus_per_node=8, model=big, layout={"kind": "ddp"}),
                    headers=ADMIN)
    assert r.status_code == 422 and r.headers["content-type"].startswith("application/problem+json")
    problem = r.json()
    assert problem["detail"].startswith("layout ddp does not fit in GPU memory on 16 GPUs: it needs ")
    assert problem["model_state_bytes"] == 30e9 * 16 and problem["needed_bytes"] > problem["usable_bytes"]
    assert problem["field"] == "layout"
    assert client.get("/v1/jobs", headers=ADMIN).json()["items"] == []  # nothing stored
    # Fully sharded over the same 16 GPUs it fits.
    ok = client.post("/v1/jobs", json=job_body(num_nodes=2, gpus_per_node=8, model=big, layout={"kind": "fsdp"}),
                     headers=ADMIN)
    assert ok.status_code == 201, ok.text
    assert ok.json()["plan"]["row"]["memory"]["model_state_bytes"] == 30e9 * 16 / 16


def test_a_job_whose_gpus_do_worse_is_accepted_with_a_warning_naming_the_better_count(client, h100s):
    # 1 Gbit/s between nodes (the operator's label): the second node costs more than it brings.
    for agent in h100s:
        client.put(f"/v1/nodes/{agent.node_id}/labels", headers=ADMIN,
                   json={"labels": {"trainyard.dev/inter-link": "ethernet", "trainyard.dev/inter-gbits-per-s": "1"}})
    r = client.post("/v1/jobs", json=job_body(num_nodes=2, gpus_per_node=8, model=MODEL), headers=ADMIN)
    assert r.status_code == 201, r.text
    job = r.json()
    assert job["plan"]["hardware"]["inter_node"]["name"] == "ethernet"
    warnings = {w["kind"]: w for w in job["plan"]["warnings"]}
    assert warnings["throughput"]["better_gpus"] == 8 and warnings["efficiency"]["better_gpus"] == 8
    events = client.get(f"/v1/jobs/{job['id']}/events", headers=ADMIN).json()["items"]
    warned = [e for e in events if e["kind"] == "job.plan_warning"]
    assert {e["data"]["reason"] for e in warned} == {"throughput", "efficiency"}
    assert all(e["data"]["better_gpus"] == 8 and e["data"]["gpus"] == 16 for e in warned)
    assert any("16 GPUs give" in e["message"] and "less than 8 GPUs" in e["message"] for e in warned)


def test_inconsistent_or_unapplied_layouts_are_422(client, h100s):
    cases = [
        ({"layout": {"kind": "tp_dp", "tp_size": 8}}, "planned only"),
        ({"layout": {"kind": "fsdp", "compression": "bf16"}}, "compression applies to ddp only"),
        ({"layout": {"kind": "hsdp", "shard_size": 3}}, "hsdp shard_size 3 must divide"),
        ({"model": {**MODEL, "global_batch": 100}}, "model.global_batch 100 is not micro_batch 2"),
        ({"model": {k: v for k, v in MODEL.items() if k != "micro_batch"}}, "needs global_batch or micro_batch"),
        ({"model": {"params": 1e9, "seq_len": 8}}, "activation_bytes_per_sample, or layers and hidden"),
    ]
    for extra, detail in cases:
        r = client.post("/v1/jobs", json=job_body(num_nodes=2, gpus_per_node=8, **extra), headers=ADMIN)
        assert r.status_code == 422, (extra, r.text)
        assert detail in r.json()["detail"], (extra, r.json())


def test_the_layout_reaches_every_node_in_its_launch_spec(client, h100s, schedule):
    layout = {"kind": "hsdp", "shard_size": 8, "grad_accum_steps": 4}
    job = client.post("/v1/jobs", json=job_body(num_nodes=2, gpus_per_node=8, layout=layout), headers=ADMIN).json()
    assert schedule() == 1
    for agent in h100s:
        specs = [s for s in agent.heartbeat()["assignments"] if s["job_id"] == job["id"]]
        assert len(specs) == 1
        assert specs[0]["layout"] == {**layout, "ddp_bucket_mb": 25.0, "compression": "none", "powersgd_rank": 1,
                                      "tp_size": 1}


def test_the_job_view_puts_the_measured_split_next_to_the_plan(client, schedule, h100s):
    body = job_body(num_nodes=2, gpus_per_node=8, model=MODEL, layout={"kind": "hsdp"})
    job = client.post("/v1/jobs", json=body, headers=ADMIN).json()
    assert job["split"] == {"predicted": job["split"]["predicted"], "measured": None, "step_ratio": None}
    row = job["plan"]["row"]
    assert job["split"]["predicted"] == {"step_s": row["step_s"], "compute_s": row["compute_s"],
                                         "comm_s": row["exposed_comm_s"],
                                         "comm_share": row["exposed_comm_s"] / row["step_s"]}
    assert schedule() == 1
    agent = h100s[0]
    spec = agent.heartbeat()["assignments"][0]
    metrics = {"step_s": 2 * row["step_s"], "compute_s": 1.5 * row["step_s"], "comm_s": 0.5 * row["step_s"],
               "comm_bytes": 1e9}
    agent.status(spec, "running", workers=workers_for(spec, "running"),
                 progress={"step": 10, "loss": 2.0, "at": "2026-12-02T10:00:00Z", "metrics": metrics})
    split = client.get(f"/v1/jobs/{job['id']}", headers=ADMIN).json()["split"]
    assert split["measured"] == {"step_s": metrics["step_s"], "compute_s": metrics["compute_s"],
                                 "comm_s": metrics["comm_s"], "comm_share": 0.25}
    assert split["step_ratio"] == pytest.approx(2.0)


def test_a_job_accepting_several_kinds_is_planned_for_the_one_with_the_least_memory(client, h100s):
    """Issue 15: ``gpu_kind`` may list kinds; the plan must hold wherever the gang lands."""
    FakeAgentSession(client, "l40s-0", 8, kind="NVIDIA L40S")
    body = job_body(num_nodes=1, gpus_per_node=8, model=MODEL, layout={"kind": "fsdp"},
                    gpu_kind=[H100, "NVIDIA L40S"])
    r = client.post("/v1/jobs", json=body, headers=ADMIN)
    assert r.status_code == 201, r.text
    assert r.json()["plan"]["hardware"]["gpu_kind"] == "l40s"
    only = client.post("/v1/jobs", json={**body, "gpu_kind": [H100]}, headers=ADMIN)
    assert only.status_code == 201, only.text
    assert only.json()["plan"]["hardware"]["gpu_kind"] == "h100-sxm"
