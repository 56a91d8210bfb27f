from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from tests.worker_runtime.fake_agent import FakeAgent
from worker_runtime import WorkerContext, device_of, init_distributed, is_distributed, shutdown_distributed
from worker_runtime.distributed import settle_ddp_buckets, tell_ready


@pytest.fixture
def restore_threads() -> Iterator[None]:
    threads = torch.get_num_threads()
    try:
        yield
    finally:
        shutdown_distributed()
        torch.set_num_threads(threads)


def test_standalone_skips_the_process_group(monkeypatch: pytest.MonkeyPatch, restore_threads: None) -> None:
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    assert init_distributed(WorkerContext(device="cpu")) is False
    assert not is_distributed()
    shutdown_distributed()  # nothing to shut down: still fine


def test_single_rank_gloo_group(monkeypatch: pytest.MonkeyPatch, restore_threads: None) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    ctx = WorkerContext(device="cpu")
    assert init_distributed(ctx, timeout=30) is True
    assert dist.get_backend() == "gloo" and dist.get_world_size() == 1
    assert torch.get_num_threads() == 1  # CPU workers share cores: one thread unless told otherwise
    assert init_distributed(ctx) is True  # idempotent
    tensor = torch.ones(2)
    dist.all_reduce(tensor)
    assert tensor.tolist() == [1.0, 1.0]
    shutdown_distributed()
    shutdown_distributed()
    assert not is_distributed()


def test_settling_ddp_buckets_changes_no_state(monkeypatch: pytest.MonkeyPatch, restore_threads: None) -> None:
    """The example pass of ``loop.ddp(model, example)`` left BatchNorm's running statistics updated
    and the torch stream advanced by dropout's draw: harmless when the restore comes after it (as in
    ``loop.steps``), but a script that calls ``loop.restore()`` first resumed from a moved state."""
    from torch.nn.parallel import DistributedDataParallel

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    assert init_distributed(WorkerContext(device="cpu"), timeout=30) is True
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Dropout(0.5),
                                torch.nn.Linear(8, 1))
    ddp = DistributedDataParallel(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    stream = torch.get_rng_state()
    settle_ddp_buckets(ddp, torch.randn(3, 4, generator=torch.Generator().manual_seed(1)))
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), [k for k in before if not torch.equal(before[k],
                                                                                                       after[k])]
    assert torch.equal(torch.get_rng_state(), stream)
    assert all(p.grad is None for p in model.parameters())
    del ddp


def test_a_managed_rank_tells_its_agent_once_its_group_is_initialised(
        monkeypatch: pytest.MonkeyPatch, restore_threads: None, fake_agent: FakeAgent) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    ctx = WorkerContext(device="cpu", attempt_id="att-1", fencing_token="tok-1", agent_url=fake_agent.url)
    assert init_distributed(ctx, timeout=30) is True
    [ready] = fake_agent.of("ready")
    assert ready.path == "/v1/local/attempts/att-1/ready" and ready.body == {"fencing_token": "tok-1", "rank": 0}
    # Best effort: an agent that refuses it or is gone never stops training.
    fake_agent.always["ready"] = 409
    assert tell_ready(ctx) is False
    gone = WorkerContext(device="cpu", attempt_id="att-1", fencing_token="tok-1", agent_url="http://127.0.0.1:9")
    assert tell_ready(gone, timeout_s=0.5) is False
    assert tell_ready(WorkerContext(device="cpu")) is False  # standalone: no agent to tell


def test_device_of() -> None:
    assert device_of(WorkerContext(device="cpu")) == torch.device("cpu")
    assert device_of(WorkerContext(device="cuda", local_rank=1, local_world_size=2, world_size=2)) == (
        torch.device("cuda", 1)
    )
