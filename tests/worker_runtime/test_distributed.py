from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from worker_runtime import WorkerContext, device_of, init_distributed, is_distributed, shutdown_distributed


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


def test_device_of() -> None:
    assert device_of(WorkerContext(device="cpu")) == torch.device("cpu")
    assert device_of(WorkerContext(device="cuda", local_rank=1, local_world_size=2, world_size=2)) == (
        torch.device("cuda", 1)
    )
