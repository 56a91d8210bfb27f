from __future__ import annotations

import io
import random
from typing import Any

import numpy as np
import pytest
import torch

from worker_runtime import (
    DataPosition,
    RngState,
    StepCounter,
    TrainState,
    WorldSizeMismatchError,
    capture_rng_state,
    restore_rng_state,
    weights_sha256,
)


def _roundtrip(state: Any) -> Any:
    # What a checkpoint does: serialise, then load with the safe loader.
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _draws() -> tuple[Any, ...]:
    return (
        [random.random() for _ in range(3)],
        random.gauss(0, 1),
        np.random.rand(3).tolist(),
        np.random.normal(),
        torch.rand(3).tolist(),
        torch.randn(2).tolist(),
    )


def test_rng_capture_restore_roundtrip() -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    random.gauss(0, 1)  # leaves a cached gaussian in python's state
    np.random.normal()
    state = _roundtrip(capture_rng_state())
    first = _draws()
    restore_rng_state(state)
    assert _draws() == first


def test_rng_state_is_a_registrable_object() -> None:
    rng = RngState()
    saved = rng.state_dict()
    first = torch.rand(4)
    rng.load_state_dict(saved)
    assert torch.equal(torch.rand(4), first)


def test_data_position_roundtrip() -> None:
    position = DataPosition(world_size=4, epoch=2, offset=17)
    position.advance(3)
    restored = DataPosition(world_size=4)
    restored.load_state_dict(_roundtrip(position.state_dict()))
    assert (restored.epoch, restored.offset, restored.world_size) == (2, 20, 4)
    restored.next_epoch()
    assert (restored.epoch, restored.offset) == (3, 0)


def test_data_position_refuses_another_world_size() -> None:
    saved = DataPosition(world_size=4, offset=10).state_dict()
    position = DataPosition(world_size=2)
    with pytest.raises(WorldSizeMismatchError, match="world_size=4 but this run has world_size=2"):
        position.load_state_dict(saved)
    assert position.offset == 0  # untouched


def test_data_position_refuses_unknown_version() -> None:
    saved = {**DataPosition(world_size=1).state_dict(), "version": 99}
    with pytest.raises(ValueError, match="version 99"):
        DataPosition(world_size=1).load_state_dict(saved)


def test_train_state_saves_and_loads_every_registered_object() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    state = TrainState()
    assert state.register("model", model) is model
    state.register("optimizer", optimizer)
    state.register("step", StepCounter(7))
    state.register("data", DataPosition(world_size=1, offset=7), per_rank=True)
    assert state.names() == ["model", "optimizer", "step", "data"]
    assert state.names(per_rank=True) == ["data"]
    assert state.names(per_rank=False) == ["model", "optimizer", "step"]
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    saved = _roundtrip(state.state_dict())

    other_model = torch.nn.Linear(3, 2)
    other = TrainState()
    other.register("model", other_model)
    other.register("optimizer", torch.optim.AdamW(other_model.parameters(), lr=0.1))
    other.register("step", StepCounter())
    other.register("data", DataPosition(world_size=1), per_rank=True)
    other.load_state_dict(saved)
    assert weights_sha256(other_model) == weights_sha256(model)
    assert other["step"].state_dict() == {"step": 7}
    assert other["optimizer"].state_dict()["state"][0]["step"] == 1


def test_only_rank_zero_saves_replicated_state() -> None:
    model = torch.nn.Linear(3, 2)
    state = TrainState()
    state.register("model", model)
    state.register("step", StepCounter(3))
    state.register("data", DataPosition(world_size=2, offset=5), per_rank=True)
    assert sorted(state.shard_state_dict(0)) == ["data", "model", "step"]
    assert sorted(state.shard_state_dict(1)) == ["data"]  # its own position; model and step are rank 0's


def test_lr_schedule_and_gradient_scaler_resume_where_they_were() -> None:
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1)
    state = TrainState()
    for name, obj in (("optimizer", optimizer), ("scheduler", scheduler), ("scaler", scaler)):
        state.register(name, obj)
    for _ in range(3):
        scaler.scale(model(torch.ones(1, 3)).sum()).backward()
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
    saved = _roundtrip(state.state_dict())

    other_optimizer = torch.optim.SGD(torch.nn.Linear(3, 2).parameters(), lr=1.0)
    other_scheduler = torch.optim.lr_scheduler.StepLR(other_optimizer, step_size=2, gamma=0.5)
    other_scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1)
    other = TrainState()
    for name, obj in (("optimizer", other_optimizer), ("scheduler", other_scheduler), ("scaler", other_scaler)):
        other.register(name, obj)
    other.load_state_dict(saved)
    assert other_scheduler.last_epoch == 3 and other_scheduler.get_last_lr() == scheduler.get_last_lr() == [0.5]
    assert other_scaler.get_scale() == scaler.get_scale() == 8192.0


def test_train_state_strict_load_names_what_is_missing() -> None:
    state = TrainState()
    state.register("step", StepCounter())
    state.register("data", DataPosition(world_size=1))
    with pytest.raises(KeyError, match=r"missing \['data'\], unexpected \['extra'\]"):
        state.load_state_dict({"step": {"step": 1}, "extra": {}})
    state.load_state_dict({"step": {"step": 1}}, strict=False)
    assert state["step"].state_dict() == {"step": 1}


def test_train_state_rejects_bad_registrations() -> None:
    state = TrainState()
    state.register("step", StepCounter())
    with pytest.raises(ValueError, match="already registered"):
        state.register("step", StepCounter())
    with pytest.raises(ValueError, match="alphanumeric"):
        state.register("a/b", StepCounter())
    with pytest.raises(TypeError, match="state_dict"):
        state.register("thing", object())  # type: ignore[type-var]


def test_weights_sha256_is_stable_and_sensitive() -> None:
    torch.manual_seed(0)
    last = torch.nn.Linear(4, 1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), last)
    digest = weights_sha256(model)
    assert digest == weights_sha256(model) and len(digest) == 64
    with torch.no_grad():
        last.bias.add_(1e-6)
    assert weights_sha256(model) != digest
    bf16 = torch.nn.Linear(2, 2).to(torch.bfloat16)  # dtypes numpy lacks still hash
    assert len(weights_sha256(bf16)) == 64
