"""The job state machine and submit validation (pure)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from control_plane.schemas.jobs import JOB_STATES, JobSubmit
from control_plane.services.runs.jobs import TERMINAL, TRANSITIONS, can_transition
from tests.factories import TINY_GPT, job_body


def test_every_state_has_a_row_and_terminal_states_are_final():
    assert set(TRANSITIONS) == set(JOB_STATES)
    for state in TERMINAL:
        assert TRANSITIONS[state] == frozenset()
    for targets in TRANSITIONS.values():
        assert targets <= set(JOB_STATES)


@pytest.mark.parametrize(("src", "dst", "ok"), [
    ("queued", "starting", True),
    ("starting", "running", True),
    ("running", "recovering", True),
    ("recovering", "starting", True),
    ("running", "cancelling", True),
    ("cancelling", "cancelled", True),
    ("succeeded", "running", False),
    ("cancelled", "queued", False),
    ("running", "queued", False),
    ("cancelling", "running", False),
    ("failed", "recovering", False),
])
def test_transitions(src, dst, ok):
    assert can_transition(src, dst) is ok


def test_every_non_terminal_state_can_reach_an_end():
    for state in set(JOB_STATES) - TERMINAL:
        seen, frontier = set(), {state}
        while frontier:
            s = frontier.pop()
            seen.add(s)
            frontier |= TRANSITIONS[s] - seen
        assert seen & TERMINAL, state


def test_submit_example_validates():
    body = JobSubmit.model_validate(TINY_GPT)
    assert body.entrypoint == "worker_runtime.examples.tiny_gpt" and body.checkpoint.interval_steps == 50


@pytest.mark.parametrize("entrypoint", ["train.py", "scripts/train.py", "pkg.mod", "/abs/path/train.py"])
def test_entrypoints_accepted(entrypoint):
    assert JobSubmit.model_validate(job_body(entrypoint=entrypoint)).entrypoint == entrypoint


@pytest.mark.parametrize("entrypoint", ["", "  ", "rm -rf /", "a..b", "x\ny"])
def test_entrypoints_refused(entrypoint):
    with pytest.raises(ValidationError):
        JobSubmit.model_validate(job_body(entrypoint=entrypoint))


def test_env_limits():
    with pytest.raises(ValidationError, match="at most"):
        JobSubmit.model_validate(job_body(env={f"K{i}": "v" * 1000 for i in range(40)}))
    with pytest.raises(ValidationError, match="set by Trainyard"):
        JobSubmit.model_validate(job_body(env={"TRAINYARD_ATTEMPT_ID": "x"}))
    with pytest.raises(ValidationError, match="valid variable name"):
        JobSubmit.model_validate(job_body(env={"1BAD": "x"}))
    assert JobSubmit.model_validate(job_body(env={"WANDB_MODE": "offline"})).env == {"WANDB_MODE": "offline"}
