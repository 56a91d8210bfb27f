"""One worker cannot stop reporting for every job on its node (issue 11, finding 7): each attempt's
trouble stays its own in the agent's loops, and a value JSON cannot carry is refused at the
boundary instead of breaking a request later. A real agent against the fake control plane over
real HTTP; the attempts here never start processes."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest

from node_agent.link.client import ControlPlaneClient, RequestRejected
from node_agent.local.api import LocalReports
from node_agent.loops.report import ReportLoop, _without_ranks
from node_agent.part.attempt import Part
from tests.node_agent.fake_control_plane import FakeControlPlane
from tests.node_agent.helpers import make_spec
from tests.node_agent.test_agent import Agents, agents, plane, wait_state  # noqa: F401
from trainyard.protocol.agent import AttemptStatusReport, LocalReady, NodeAttemptState, Progress

__all__ = ["agents", "plane"]


def _unencodable(*_: Any) -> AttemptStatusReport:
    # What a NaN in a progress report did before it was refused at the local API: httpx raised
    # ValueError while encoding the status report, inside the agent's report loop.
    raise ValueError("Out of range float values are not JSON compliant")


def test_one_attempts_broken_report_never_stops_the_others(agents: Agents, plane: FakeControlPlane) -> None:
    agent = agents.start()
    assert agent.state.registered.wait(20)
    bad, good = (make_spec(nproc_per_node=1, gpu_indices=[0]) for _ in range(2))
    runs = []
    for spec in (bad, good):  # the broken one first: the loop meets it before the other every round
        assert agent.state.parts is not None
        paths = agent.state.parts.paths(spec.attempt_id, spec.node_rank)
        runs.append(Part.failed(spec, paths, "could not run it here", stop_grace_s=1.0, create_dir=False))
    runs[0].report = _unencodable  # type: ignore[method-assign]
    with agent.state.runs_lock:
        agent.state.by_id.update({run.attempt_id: run for run in runs})
    final = wait_state(plane, good.attempt_id, NodeAttemptState.exited, timeout=15)
    assert final.error == "could not run it here"
    assert plane.last_status(bad.attempt_id) is None  # still trying, alone
    assert agent._threads["report"].is_alive()


def test_a_report_json_cannot_carry_is_refused_before_it_is_sent() -> None:
    client = ControlPlaneClient("http://127.0.0.1:9", join_token="j")  # nothing listens: nothing is sent
    client.node_token = "n"
    report = AttemptStatusReport.model_construct(
        fencing_token="f", node_rank=0, state=NodeAttemptState.running, exit_code=None, workers=[],
        progress=Progress.model_construct(step=1, loss=math.nan, at=None, metrics={}), result={"x": math.inf},
        error=None,
    )
    with pytest.raises(RequestRejected, match="cannot encode"):
        client.report_status("a", report)
    client.close()


def test_progress_that_is_not_finite_is_not_a_valid_report() -> None:
    from pydantic import ValidationError

    from trainyard.protocol.agent import LocalProgress

    for value in (math.nan, math.inf, -math.inf):
        with pytest.raises(ValidationError):
            LocalProgress(fencing_token="f", rank=0, step=1, loss=value)
        with pytest.raises(ValidationError):
            LocalProgress(fencing_token="f", rank=0, step=1, metrics={"m": value})


def test_a_report_carries_its_parts_ages_and_the_first_that_says_initialised_is_new() -> None:
    spec = make_spec(nproc_per_node=2, gpu_indices=[0, 1])
    woken: list[bool] = []
    reports = LocalReports(on_ready=lambda: woken.append(True))  # the agent wakes its report loop
    reports.register(spec.attempt_id, spec.fencing_token)
    run = SimpleNamespace(attempt_id=spec.attempt_id, spec=spec, received_at=100.0)
    loop = SimpleNamespace(state=SimpleNamespace(reports=reports))
    base = AttemptStatusReport(fencing_token=spec.fencing_token, node_rank=0, state=NodeAttemptState.running)
    before = ReportLoop._with_timings(loop, run, base, 102.5)  # type: ignore[arg-type]
    assert before.received_s_ago == 2.5 and before.initialized_s_ago is None
    later = ReportLoop._with_timings(loop, run, base, 103.5)  # type: ignore[arg-type]
    assert _without_ranks(later) == _without_ranks(before)  # an age that grew is no news
    for rank in (0, 1):
        reports.set_ready(spec.attempt_id, LocalReady(fencing_token=spec.fencing_token, rank=rank))
    ready = reports.initialized_at(spec.attempt_id, 2)
    assert ready is not None and woken == [True, True]
    now = ready + 0.25
    after = ReportLoop._with_timings(loop, run, base, now)  # type: ignore[arg-type]
    assert after.initialized_s_ago == 0.25
    assert _without_ranks(after) != _without_ranks(before)  # sent at once, not at the next periodic report
    adopted = SimpleNamespace(attempt_id=spec.attempt_id, spec=spec, received_at=None)  # after an agent restart
    assert ReportLoop._with_timings(loop, adopted, base, now).received_s_ago is None  # type: ignore[arg-type]
