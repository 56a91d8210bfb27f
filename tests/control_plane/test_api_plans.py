"""POST /v1/plans and `trainyard plan` on a real Postgres: the table and the recommendation, node
labels setting the link figures of their GPU kind, 422 with the numbers, limits in the OpenAPI
schema, no 500 for any body (hypothesis, bounded), and the CLI's table and one-line errors."""

from __future__ import annotations

import copy
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from control_plane.planning.catalog import LABEL_GPU_MEMORY, LABEL_INTER_GBITS, LABEL_INTER_LINK
from control_plane.schemas.plans import PLAN_EXAMPLE
from tests.control_plane.helpers import serve
from tests.factories import ADMIN, ADMIN_TOKEN, register_node
from trainyard.cli import main

H100 = "NVIDIA H100 80GB HBM3"


def plan_body(**overrides: object) -> dict:
    body = copy.deepcopy(PLAN_EXAMPLE)
    model = overrides.pop("model", None)
    if isinstance(model, dict):
        body["model"].update(model)
    body.update(overrides)
    return body


def test_the_example_returns_every_layout_on_every_count_and_a_recommendation(client):
    r = client.post("/v1/plans", json=PLAN_EXAMPLE, headers=ADMIN)
    assert r.status_code == 200, r.text
    plan = r.json()
    assert plan["hardware"]["gpu_kind"] == "h100-sxm" and plan["hardware"]["cluster_nodes"] == 0
    assert [(row["layout"]["kind"], row["gpus"]) for row in plan["rows"]] == [
        (kind, n) for kind in ("ddp", "fsdp", "hsdp", "tp_dp") for n in PLAN_EXAMPLE["gpu_counts"]]
    rec = plan["recommendation"]
    assert rec["layout"]["kind"] in ("ddp", "fsdp", "hsdp") and rec["gpus"] in PLAN_EXAMPLE["gpu_counts"]
    assert rec["reason"].startswith(f"{rec['layout']['kind']} on {rec['gpus']} GPUs")
    chosen = next(row for row in plan["rows"] if row["layout"] == rec["layout"] and row["gpus"] == rec["gpus"])
    assert chosen["feasible"] and chosen["memory"]["fits"]
    assert chosen["scaling_efficiency"] >= plan["min_efficiency"] == 0.7  # the server's setting
    assert plan["model"]["bytes_per_param"]["total"] == 16


def test_node_labels_set_the_link_figures_of_their_gpu_kind(client):
    # Two H100 nodes on 100G Ethernet (their agents say so); the operator knows one has 50G only.
    a = register_node(client, "gpu-a", 8, kind=H100, labels={LABEL_INTER_LINK: "ethernet", LABEL_INTER_GBITS: "100"})
    register_node(client, "gpu-b", 8, kind=H100, labels={LABEL_INTER_LINK: "ethernet", LABEL_INTER_GBITS: "100",
                                                       LABEL_GPU_MEMORY: "lots"})
    r = client.put(f"/v1/nodes/{a['node_id']}/labels", json={"labels": {LABEL_INTER_GBITS: "50"}}, headers=ADMIN)
    assert r.status_code == 200, r.text
    plan = client.post("/v1/plans", json=plan_body(gpu_kind="h100"), headers=ADMIN).json()
    hw = plan["hardware"]
    assert hw["cluster_nodes"] == 2
    assert hw["inter_node"]["name"] == "ethernet" and hw["sources"]["inter_link"] == f"label {LABEL_INTER_LINK}"
    assert hw["inter_node"]["gbytes_per_s"] == pytest.approx(50 / 8 * 0.6 / 8)  # the slowest node, its share
    assert plan["notes"] == [f"node gpu-b: label {LABEL_GPU_MEMORY}='lots' is not a positive number; ignored"]
    # Another kind: the cluster's labels do not apply.
    other = client.post("/v1/plans", json=plan_body(gpu_kind="h200"), headers=ADMIN).json()
    assert other["hardware"]["cluster_nodes"] == 0 and other["hardware"]["inter_node"]["name"] == "infiniband"
    # The request's own figures win.
    mine = client.post("/v1/plans", json=plan_body(gpu_kind="h100", hardware={"inter_gbits_per_s": 3200}),
                       headers=ADMIN).json()
    assert mine["hardware"]["sources"]["inter_bandwidth"] == "request"
    slow = {(row["layout"]["kind"], row["gpus"]): row for row in plan["rows"]}
    fast = {(row["layout"]["kind"], row["gpus"]): row for row in mine["rows"]}
    assert slow["fsdp", 128]["exposed_comm_s"] > fast["fsdp", 128]["exposed_comm_s"]


def test_impossible_inputs_are_422_problems_with_the_numbers(client):
    r = client.post("/v1/plans", json=plan_body(model={"params": 1e13}, gpu_counts=[8], layouts=[{"kind": "ddp"}]),
                    headers=ADMIN)
    assert r.status_code == 422 and r.headers["content-type"].startswith("application/problem+json")
    problem = r.json()
    assert problem["detail"].startswith("nothing fits: the least memory any layout needs is")
    assert problem["least_memory_bytes"] > problem["usable_memory_bytes"] > 0 and problem["gpus"] == 8
    unknown = client.post("/v1/plans", json=plan_body(gpu_kind="Tesla K80"), headers=ADMIN)
    assert unknown.status_code == 422 and unknown.json()["field"] == "gpu_kind"
    assert "give hardware.gpu_memory_gib and hardware.peak_tflops" in unknown.json()["detail"]
    shapeless = client.post("/v1/plans", json=plan_body(model={"layers": None, "params": 1e9}), headers=ADMIN)
    assert shapeless.status_code == 422
    assert "activation_bytes_per_sample, or layers and hidden" in shapeless.json()["detail"]
    assert client.post("/v1/plans", json=PLAN_EXAMPLE).status_code == 401


def test_the_openapi_schema_carries_the_limits(client):
    schemas = client.get("/openapi.json").json()["components"]["schemas"]
    model = schemas["PlanModelIn"]["properties"]
    assert model["params"]["anyOf"][0]["maximum"] == 1e15 and model["seq_len"]["maximum"] == 10_000_000
    assert model["global_batch"]["maximum"] == 100_000_000 and model["mfu"]["minimum"] == 0.001
    request = schemas["PlanRequest"]["properties"]
    assert request["gpu_counts"]["anyOf"][0]["maxItems"] == 64 and request["gpus_per_node"]["maximum"] == 64
    assert schemas["HardwareIn"]["properties"]["inter_gbits_per_s"]["anyOf"][0]["minimum"] == 0.001


def _bodies() -> st.SearchStrategy[dict]:
    """Plan requests across (and just beyond) the schema's limits."""
    maybe = st.one_of
    model = st.fixed_dictionaries({
        "seq_len": st.integers(0, 10_000_001), "global_batch": st.integers(0, 100_000_001),
    }, optional={
        "params": st.floats(0, 2e15), "layers": st.integers(1, 100_000), "hidden": st.integers(1, 1_000_000),
        "vocab": st.integers(0, 100_000_000), "heads": st.integers(1, 100_000),
        "micro_batch": st.integers(1, 1_000_000),
        "activation_bytes_per_sample": st.floats(0, 1e15), "mfu": st.floats(0, 1.5),
        "activation_checkpointing": st.booleans(), "precision": st.sampled_from(["bf16-mixed", "fp32", "int8"]),
    })
    hardware = st.fixed_dictionaries({}, optional={
        "gpu_memory_gib": st.floats(0.001, 100_000), "peak_tflops": st.floats(1e-6, 1e6),
        "intra_gbytes_per_s": st.floats(0.001, 100_000), "inter_gbits_per_s": st.floats(0.001, 10_000_000),
        "inter_latency_us": st.floats(0, 1_000_000), "link_efficiency": st.floats(0.01, 1),
        "memory_reserve": st.floats(0, 0.99),
    })
    layout = st.fixed_dictionaries({"kind": st.sampled_from(["ddp", "fsdp", "hsdp", "tp_dp"])}, optional={
        "shard_size": st.integers(1, 4096), "tp_size": st.integers(1, 64), "ddp_bucket_mb": st.floats(1e-6, 4096),
        "compression": st.sampled_from(["none", "bf16", "powersgd"])})
    return st.fixed_dictionaries({
        "model": model, "gpu_kind": st.sampled_from(["h100", "l4", "virtual-cpu", "NVIDIA B200", "unknown"]),
        "gpus_per_node": st.integers(1, 64),
    }, optional={
        "gpu_counts": st.lists(maybe(st.integers(1, 1_000_000), st.sampled_from([1, 8, 64, 512])), min_size=1,
                               max_size=8),
        "layouts": st.lists(layout, min_size=1, max_size=4), "hardware": hardware,
        "min_efficiency": st.floats(0, 1),
    })


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=_bodies())
def test_no_plan_request_gets_a_500(client, body):
    r = client.post("/v1/plans", json=body, headers=ADMIN)
    assert r.status_code in (200, 422), r.text
    if r.status_code == 200:
        assert r.json()["rows"]


def test_trainyard_plan_prints_the_table_and_fails_in_one_line(app, capsys, monkeypatch):
    monkeypatch.setenv("TRAINYARD_TOKEN", ADMIN_TOKEN)  # never an argument
    with serve(app) as url:
        with pytest.raises(SystemExit) as done:
            main(["plan", "--control-plane", url, "--params", "7.5e9", "--layers", "32",
                  "--hidden", "4096", "--seq-len", "4096", "--global-batch", "512", "--micro-batch", "1",
                  "--gpu-kind", "h100", "--gpus", "8,64", "--layout", "ddp", "--layout", "fsdp",
                  "--layout", "hsdp:8"])
        assert done.value.code == 0
        out = capsys.readouterr().out
        assert "7.5B parameters, 16 B/param (120.0 GB of model state)" in out
        # ddp on 8 and 64 GPUs: 120 GB of state, 30 GB of fp32 buckets, 15 GB of autocast's copies, 18.3 GB
        # of activations.
        assert out.count("183.3 (no fit)") == 2
        assert "Recommended (* above): hsdp on 64 GPUs" in out and "* hsdp:8" in out
        assert "ddp does not fit (needs 183.3 GB per GPU" in " ".join(out.split())
        with pytest.raises(SystemExit) as done:
            main(["plan", "--control-plane", url, "--params", "1e13", "--seq-len", "4096",
                  "--activation-bytes", "0", "--global-batch", "512", "--gpu-kind", "h100", "--gpus", "8",
                  "--layout", "ddp", "--json"])
        assert done.value.code == 1
        err = capsys.readouterr().err.strip()
        assert err.startswith("trainyard: error: 422: nothing fits: the least memory any layout needs is")
        assert "\n" not in err
        with pytest.raises(SystemExit) as done:
            main(["plan", "--control-plane", url, "--params", "1e9", "--seq-len", "8",
                  "--activation-bytes", "0", "--global-batch", "8", "--gpu-kind", "h100", "--gpus", "8",
                  "--layout", "ddp", "--json"])
        assert done.value.code == 0
        assert json.loads(capsys.readouterr().out)["rows"][0]["gpus"] == 8
    with pytest.raises(SystemExit) as done:
        main(["plan", "--control-plane", url, "--params", "1e9", "--seq-len", "8", "--global-batch", "8",
              "--gpu-kind", "h100"])
    assert done.value.code == 1
    assert capsys.readouterr().err.startswith(f"trainyard: error: cannot reach the control plane at {url}")
    with pytest.raises(SystemExit) as done:
        main(["plan", "--params", "1e9", "--seq-len", "8", "--global-batch", "8", "--gpu-kind", "h100",
              "--gpus", "8,x"])
    assert done.value.code == 2 and "--gpus '8,x' must be whole numbers" in capsys.readouterr().err
