"""Agent lifecycle faults with real processes (issue 9): launch failures that must be reported, an
agent restarted mid-attempt, a final status that arrives late, process groups whose id was reused."""

from __future__ import annotations

import shutil

from control_plane.schemas.agent import NodeAttemptState
from tests.node_agent.fake_control_plane import FakeControlPlane
from tests.node_agent.test_agent import NODE, SLEEPER, Agents, agents, plane, wait_state  # noqa: F401

__all__ = ["agents", "plane"]


def test_attempt_dir_that_cannot_be_made_is_reported_as_the_parts_failure(
    agents: Agents, plane: FakeControlPlane
) -> None:
    agent = agents.start()
    attempts_dir = agents.tmp_path / "agent" / "attempts"
    shutil.rmtree(attempts_dir)
    attempts_dir.write_text("not a directory")  # mkdir of attempts/<id> fails for real (ENOTDIR)
    spec = agents.spec("sleep.py", SLEEPER, nproc_per_node=1, gpu_indices=[0])
    plane.assign(NODE, spec)
    final = wait_state(plane, spec.attempt_id, NodeAttemptState.exited, timeout=15)
    assert final.error is not None and "could not create the attempt directory" in final.error
    assert final.fencing_token == spec.fencing_token
    # Reported once, never launched: the agent keeps no process and forgets it after the ack.
    assert agent.run(spec.attempt_id) is None or not agent.run(spec.attempt_id).alive  # type: ignore[union-attr]
