from __future__ import annotations

import math
import socket
import time

import pytest

from tests.worker_runtime.fake_agent import FakeAgent
from trainyard.protocol.agent import LocalProgress, LocalResult
from worker_runtime import Reporter, ReportError, StaleAttemptError, WorkerContext


def _ctx(url: str | None, rank: int = 0) -> WorkerContext:
    return WorkerContext(
        attempt_id="att-1",
        fencing_token="tok-1",
        agent_url=url,
        rank=rank,
        world_size=2,
        device="cpu",
    )


def test_progress_and_result_speak_the_contract(fake_agent: FakeAgent) -> None:
    with Reporter(_ctx(fake_agent.url)) as reporter:
        reporter.progress(3, loss=1.5, lr=0.01)
        [sent] = fake_agent.wait_for("progress", 1)
        reporter.result({"final_loss": 0.5, "steps": 3})
    assert sent.path == "/v1/local/attempts/att-1/progress"
    body = LocalProgress.model_validate(sent.body)
    assert (body.fencing_token, body.rank, body.step) == ("tok-1", 0, 3)
    assert (body.loss, body.metrics) == (1.5, {"lr": 0.01})
    [result] = fake_agent.of("result")
    assert result.path == "/v1/local/attempts/att-1/result"
    assert LocalResult.model_validate(result.body).result == {"final_loss": 0.5, "steps": 3}
    assert reporter.sent_progress == 1


def test_progress_is_rate_limited_and_flush_sends_the_latest(fake_agent: FakeAgent) -> None:
    reporter = Reporter(_ctx(fake_agent.url), min_interval_s=0.5)
    for step in range(200):
        reporter.progress(step, loss=float(step))
    assert reporter.flush()
    steps = [r.body["step"] for r in fake_agent.of("progress")]
    assert 1 <= len(steps) <= 3, steps
    assert steps[-1] == 199  # the latest wins; nothing in between is queued
    reporter.close()
    assert len(fake_agent.of("progress")) == len(steps)  # nothing new: close sends no duplicate


def test_progress_never_blocks_on_a_hung_agent(fake_agent: FakeAgent) -> None:
    fake_agent.gate.clear()  # the agent accepts connections but never answers
    reporter = Reporter(_ctx(fake_agent.url), min_interval_s=0.0, progress_timeout_s=5.0)
    started = time.monotonic()
    for step in range(1000):
        reporter.progress(step, loss=1.0)
    assert time.monotonic() - started < 1.0
    fake_agent.gate.set()
    assert reporter.flush(timeout=10)
    assert fake_agent.of("progress")[-1].body["step"] == 999
    reporter.close()


def test_progress_survives_an_unreachable_agent(caplog: pytest.LogCaptureFixture) -> None:
    url = f"http://127.0.0.1:{_closed_port()}"
    reporter = Reporter(_ctx(url), min_interval_s=0.0, result_tries=2, retry_backoff_s=0.01)
    for step in range(50):
        reporter.progress(step, loss=1.0)
    reporter.flush(timeout=5)
    assert reporter.sent_progress == 0 and not reporter.stale
    assert "progress not delivered" in caplog.text
    with pytest.raises(ReportError, match="after 2 tries"):
        reporter.result({"final_loss": 1.0})
    reporter.close()


def test_stale_progress_stops_reporting_without_raising(fake_agent: FakeAgent) -> None:
    fake_agent.always["progress"] = 409
    reporter = Reporter(_ctx(fake_agent.url), min_interval_s=0.0)
    reporter.progress(1, loss=1.0)
    fake_agent.wait_for("progress", 1)
    assert reporter.flush()
    assert reporter.stale
    reporter.progress(2, loss=1.0)
    reporter.close()
    assert len(fake_agent.of("progress")) == 1


def test_stale_result_raises(fake_agent: FakeAgent) -> None:
    fake_agent.always["result"] = 409
    with Reporter(_ctx(fake_agent.url)) as reporter, pytest.raises(StaleAttemptError):
        reporter.result({"final_loss": 1.0})
    assert len(fake_agent.of("result")) == 1  # a stale attempt is final: no retry


def test_result_is_retried_through_server_errors(fake_agent: FakeAgent) -> None:
    fake_agent.statuses["result"] = [503, 500]
    with Reporter(_ctx(fake_agent.url), retry_backoff_s=0.01) as reporter:
        reporter.result({"final_loss": 1.0})
    assert len(fake_agent.of("result")) == 3


def test_result_gives_up_after_its_tries(fake_agent: FakeAgent) -> None:
    fake_agent.always["result"] = 503
    reporter = Reporter(_ctx(fake_agent.url), result_tries=3, retry_backoff_s=0.01)
    with reporter, pytest.raises(ReportError, match="after 3 tries: HTTP 503"):
        reporter.result({"final_loss": 1.0})
    assert len(fake_agent.of("result")) == 3


def test_rejected_result_is_not_retried(fake_agent: FakeAgent) -> None:
    fake_agent.always["result"] = 422
    reporter = Reporter(_ctx(fake_agent.url), retry_backoff_s=0.01)
    with reporter, pytest.raises(ReportError, match="rejected the result: HTTP 422"):
        reporter.result({"final_loss": 1.0})
    assert len(fake_agent.of("result")) == 1


def test_result_flushes_progress_first_and_sends_non_finite_as_null(fake_agent: FakeAgent) -> None:
    with Reporter(_ctx(fake_agent.url), min_interval_s=60) as reporter:
        reporter.progress(1, loss=2.0)
        fake_agent.wait_for("progress", 1)
        reporter.progress(2, loss=math.nan, bad=math.inf, good=1.0)  # held back by the rate limit
        reporter.result({"final_loss": math.nan, "losses": [1.0, math.inf]})
    kinds = [r.path.rsplit("/", 1)[-1] for r in fake_agent.requests]
    assert kinds == ["progress", "progress", "result"]
    last = fake_agent.of("progress")[-1].body
    assert last["loss"] is None and last["metrics"] == {"good": 1.0}
    assert fake_agent.of("result")[0].body["result"] == {"final_loss": None, "losses": [1.0, None]}


def test_other_ranks_report_step_and_timings_only(fake_agent: FakeAgent) -> None:
    # Every rank feeds its node's RankSummary (the watchdogs); only rank 0's loss, metrics and
    # result speak for the attempt, unless all_ranks.
    with Reporter(_ctx(fake_agent.url, rank=1), min_interval_s=0.0) as reporter:
        reporter.progress(1, loss=1.0, lr=0.1)
        with reporter.timed():
            time.sleep(0.02)
        reporter.progress(3, loss=0.5)
        reporter.result({"x": 1})
    bodies = [r.body for r in fake_agent.of("progress")]
    assert fake_agent.of("result") == [] and bodies[-1]["step"] == 3
    assert all(b["rank"] == 1 and b["loss"] is None and b["metrics"] == {} for b in bodies)
    assert bodies[-1]["step_time_s"] > 0 and 0.01 / 2 <= bodies[-1]["busy_s"] < bodies[-1]["step_time_s"]
    fake_agent.requests.clear()
    with Reporter(_ctx(fake_agent.url, rank=1), all_ranks=True) as reporter:
        reporter.progress(1, loss=1.0)
    assert fake_agent.of("progress")[0].body["loss"] == 1.0


def test_a_rank_blocked_between_reports_keeps_reporting(fake_agent: FakeAgent) -> None:
    # A rank waiting in a collective sends its last report again every keepalive_s: only a stopped
    # process falls silent (which the hang watchdog names).
    with Reporter(_ctx(fake_agent.url, rank=1), min_interval_s=0.0, keepalive_s=0.05) as reporter:
        reporter.progress(7)
        deadline = time.monotonic() + 5
        while len(fake_agent.of("progress")) < 4 and time.monotonic() < deadline:
            time.sleep(0.02)
    steps = [r.body["step"] for r in fake_agent.of("progress")]
    assert len(steps) >= 4 and set(steps) == {7}


def test_standalone_prints_instead(capsys: pytest.CaptureFixture[str]) -> None:
    with Reporter(_ctx(None), min_interval_s=60) as reporter:
        reporter.progress(1, loss=2.0)
        reporter.progress(2, loss=1.0, lr=0.5)
        reporter.flush()
        reporter.result({"final_loss": 1.0})
    err = capsys.readouterr().err.splitlines()
    assert err[-2:] == ["[trainyard] step=2 loss=1 lr=0.5", '[trainyard] result {"final_loss": 1.0}']
    with Reporter(_ctx(None), echo=False) as quiet:
        quiet.progress(1, loss=1.0)
        quiet.result({"final_loss": 1.0})
    assert capsys.readouterr().err == ""


def test_unserialisable_result_fails_before_sending(fake_agent: FakeAgent) -> None:
    with Reporter(_ctx(fake_agent.url)) as reporter, pytest.raises(TypeError):
        reporter.result({"tensor": object()})
    assert fake_agent.requests == []


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_reports_go_over_the_attempts_unix_socket() -> None:
    """The agent serves each attempt on a unix socket of its own (TRAINYARD_AGENT_SOCKET)."""
    import tempfile
    from pathlib import Path

    from node_agent.local.api import BASE_URL, LocalApi

    with tempfile.TemporaryDirectory(prefix="rs-", dir="/tmp") as directory:
        api = LocalApi()
        api.reports.register("att-u", "tok-u")
        api.open("att-u", Path(directory) / "att-u.0.sock")
        try:
            ctx = WorkerContext.from_env({"TRAINYARD_AGENT_URL": BASE_URL, "TRAINYARD_ATTEMPT_ID": "att-u",
                                          "TRAINYARD_FENCING_TOKEN": "tok-u", "TRAINYARD_DEVICE": "cpu",
                                          "TRAINYARD_AGENT_SOCKET": str(Path(directory) / "att-u.0.sock")})
            with Reporter(ctx, echo=False) as reporter:
                reporter.progress(5, loss=0.5, nan_metric=float("nan"))
                reporter.flush()
                reporter.result({"ok": 1, "nan": float("nan")})
            progress, result = api.reports.snapshot("att-u")
            assert progress is not None and progress.step == 5 and progress.metrics == {}
            assert result == {"ok": 1, "nan": None}
            # An 'auto' job's checkpoint interval is read over the same socket.
            from worker_runtime.checkpoint.notify import CheckpointReporter
            api.reports.set_checkpoint_interval("att-u", 40)
            assert CheckpointReporter(ctx).checkpoint_interval() == 40
        finally:
            api.stop()
