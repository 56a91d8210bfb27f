"""The agent's report and relay loops, and the storage grants it forwards for workers.

- report (``ReportLoop``): send each attempt's status when it changes (and every
  status_interval_s), ship new log bytes, and send the final status and last bytes after the end
  until acknowledged. The final status waits until the attempt's queued shards and events are
  delivered: a checkpoint reported just before the exit reaches the control plane before the
  attempt is seen to end.
- relay (``RelayLoop``): forward the checkpoint shards, events and upload-slot requests workers
  post to the local API, in order, as soon as they are queued (link/relay.py, link/upload_slots.py),
  and their requests for storage grants (link/storage_grants.py); the slot and storage requests of
  the node's ranks that come together go as one request (link/batcher.py).
"""

from __future__ import annotations

import time
from http import HTTPStatus
from typing import Any

from node_agent.link.client import (
    ControlPlaneUnavailable,
    RequestRejected,
    StaleAttempt,
    Unauthorized,
)
from node_agent.link.relay import Relay
from node_agent.link.storage_grants import GrantRelay
from node_agent.link.upload_slots import SlotRelay
from node_agent.loops.state import AgentState
from node_agent.part.attempt import Part
from trainyard.protocol.agent import (
    AttemptStatusReport,
    LogBatch,
    NodeAttemptState,
)
from trainyard.protocol.grants import LocalStorageRequest

_REPORT_INTERVAL_S = 0.5
_LOG_BATCHES_PER_ROUND = 4
_FINAL_STATES = (NodeAttemptState.exited, NodeAttemptState.stopped)


class ReportLoop:
    def __init__(self, state: AgentState) -> None:
        self.state = state

    def step(self) -> float:
        """One pass of the loop over every part; the seconds until the next."""
        state = self.state
        if state.need_register.is_set() or state.client.node_token is None:
            return _REPORT_INTERVAL_S
        for run in state.runs():
            if run.done:
                continue
            try:
                if run.stale:
                    # Fenced off: no more status, but the last lines its ranks wrote before the stop
                    # still go (a failed attempt's last words), until its files are read to the end.
                    if not run.parked and not run.logs_closed and not state.need_register.is_set():
                        self._ship_logs(run)
                    continue
                self._report_status(run)
                if not run.stale and not state.need_register.is_set():
                    self._ship_logs(run)
            except Exception:
                # One attempt's bad report (a value its worker sent that cannot be encoded, say) must
                # never stop the reports of the others; it is tried again next round.
                run.log.exception("report_failed")
                run.next_try_at = time.monotonic() + state.config.status_interval_s
        return _REPORT_INTERVAL_S

    def _report_status(self, run: Part) -> None:
        state = self.state
        now = time.monotonic()
        finished = run.finished  # before the report: a final report must describe a finished run
        if finished and run.final_acked:
            return
        report = run.report(*state.reports.snapshot(run.attempt_id), state.reports.rank_summary(run.attempt_id))
        report = self._with_timings(run, report, now)
        if finished and run.attempt_id not in state.orphans.alive:
            # The process table has nothing of it left: the control plane releases its GPUs on this
            # report, a heartbeat sooner than the one that stops listing it.
            report = report.model_copy(update={"processes_alive": False})
        if report.state in _FINAL_STATES and state.outbox.pending(run.attempt_id):
            return  # the relay delivers the attempt's last shards and events first
        # The rank summary rides on the periodic report (its silences change at every look): a
        # 128-node job would otherwise send a report per node per step.
        due = (_without_ranks(report) != _without_ranks(run.last_report)
               or now - run.last_sent_at >= state.config.status_interval_s)
        refused = state.refused_reports.get(run.attempt_id)
        if not due or now < run.next_try_at or _without_ranks(refused) == _without_ranks(report):
            return
        try:
            ack = state.client.report_status(run.attempt_id, report)
        except StaleAttempt as exc:
            state.fence_off(run, exc)
            return
        except Unauthorized:
            state.need_register.set()
            return
        except RequestRejected as exc:
            if finished:
                # An answer, not a missing message: resending it would be refused forever, so the
                # attempt stops being listed as pending and the control plane decides without it.
                run.log.error("final_status_rejected", error=str(exc))
                run.mark_final_acked()
                state.wake("heartbeat")  # its GPUs are released by the heartbeat that no longer lists it
                return
            # Refused for what it says (a 4xx other than fencing): the same report would be refused
            # forever. Dropped, said once in the log; the next report that differs goes out.
            run.log.error("status_report_dropped", error=str(exc))
            if report.state == NodeAttemptState.parked and run.parked:
                state.unpark(run, f"the control plane refused the park: {exc}")  # nobody will take it over
            state.refused_reports[run.attempt_id] = report
            run.last_report, run.last_sent_at = report, now
            return
        except ControlPlaneUnavailable as exc:
            run.log.warning("status_report_failed", error=str(exc))
            run.next_try_at = now + min(state.config.status_interval_s, 2.0)
            return
        run.last_report, run.last_sent_at = report, now
        state.reports.set_checkpoint_interval(run.attempt_id, ack.checkpoint_interval_steps)
        if finished:
            run.mark_final_acked()
            if not ack.released:
                state.wake("heartbeat")  # an older control plane: the heartbeat confirms the release
        elif ack.stop:
            state.stop_or_park(run, "the control plane asked", handover_ok=ack.handover_ok)

    def _with_timings(self, run: Part, report: AttemptStatusReport, now: float) -> AttemptStatusReport:
        """The part's received and initialised instants, as ages at ``now`` by this agent's monotonic
        clock (the control plane puts them on its own clock: this node's wall clock may be off)."""
        initialized = self.state.reports.initialized_at(run.attempt_id, run.spec.nproc_per_node)
        return report.model_copy(update={
            "received_s_ago": None if run.received_at is None else round(max(0.0, now - run.received_at), 4),
            "initialized_s_ago": None if initialized is None else round(max(0.0, now - initialized), 4),
        })

    def _ship_logs(self, run: Part) -> None:
        state = self.state
        final = run.finished
        for _ in range(_LOG_BATCHES_PER_ROUND):  # bounded, so one chatty attempt starves no other
            batch = run.tailer.next_batch(final=final)
            if not batch:
                if final and run.final_acked:
                    run.mark_done()
                elif final and run.stale:
                    run.logs_closed = True  # every byte shipped: supervision may finish it now
                    state.wake("supervise")
                return
            body = LogBatch(
                fencing_token=run.spec.fencing_token,
                node_rank=run.spec.node_rank,
                chunks=[pending.chunk for pending in batch],
            )
            try:
                state.client.send_logs(run.attempt_id, body)
            except StaleAttempt as exc:
                if run.stale:
                    run.logs_closed = True  # refused even under its own token: nothing more is taken
                    return
                state.fence_off(run, exc)
                return
            except Unauthorized:
                state.need_register.set()
                return
            except ControlPlaneUnavailable as exc:
                run.log.warning("log_shipping_failed", error=str(exc))
                return
            except RequestRejected as exc:
                # Resending the same bytes would be rejected forever and wedge this rank's stream.
                run.log.error("log_batch_dropped", error=str(exc), chunks=len(batch))
            run.tailer.acknowledge(batch)

class RelayLoop:
    def __init__(self, state: AgentState) -> None:
        self.state = state
        self.relay = Relay(state.outbox, state.client, target=self.target, on_stale=self.stale,
                           on_unauthorized=state.need_register.set)
        """Shards and events, in order (link/relay.py)."""
        self.slots = SlotRelay(state.client, target=self.target, on_stale=self.stale,
                               on_unauthorized=state.need_register.set, ranks=self.ranks,
                               window_s=state.config.batch_window_s)
        """Upload-slot requests (link/upload_slots.py), which the local API forwards at once, a node's
        together (link/batcher.py)."""
        self.grants = GrantRelay(state.client, target=self.node_rank, on_unauthorized=state.need_register.set,
                                 ranks=self.ranks, window_s=state.config.batch_window_s)
        """Storage requests (link/storage_grants.py), the same way."""

    def step(self) -> float:
        """One pass of the loop: forward what is queued; the seconds until the next."""
        state = self.state
        if state.need_register.is_set() or state.client.node_token is None:
            return _REPORT_INTERVAL_S  # items stay queued
        # Sleeps on the outbox rather than the stop event, so that a new item goes out at once.
        state.outbox.wait(self.relay.step())
        return 0.0

    def target(self, attempt_id: str) -> tuple[str, int] | None:
        """Whom a relayed request about ``attempt_id`` speaks for: its fencing token and node rank."""
        run = self.state.run(attempt_id)
        if run is None or run.stale:
            return None
        return run.spec.fencing_token, run.spec.node_rank

    def stale(self, attempt_id: str, exc: StaleAttempt) -> None:
        """A worker's relayed request (a shard, an event, an upload slot) was refused as stale."""
        state = self.state
        run = state.run(attempt_id)
        if run is None or run.stale:
            return
        if not run.parked and run.parkable():
            # The attempt ended: a restartable part whose workers all run may be the one the next
            # attempt takes over, and only the control plane's stop says whether (handover_ok). A
            # relay's refusal says nothing of it, so it must not stop the part first: the part's
            # status report goes out now, and its answer parks or stops it (a stale answer to the
            # report itself fences it off as before).
            run.log.info("relay_refused_stale_asking_for_stop", error=str(exc))
            run.last_sent_at = run.next_try_at = float("-inf")
            state.wake("report")
            state.wake("heartbeat")
            return
        state.fence_off(run, exc)

    def storage_grants(self, attempt_id: str, body: LocalStorageRequest) -> tuple[HTTPStatus, dict[str, Any]]:
        """Forward a worker's request for presigned checkpoint URLs (trainyard/protocol/grants.py)
        with this node's credential and the attempt's node rank; the control plane's answer."""
        return self.grants.forward(attempt_id, body)

    def node_rank(self, attempt_id: str) -> int | None:
        target = self.target(attempt_id)
        return None if target is None else target[1]

    def ranks(self, attempt_id: str) -> int:
        """The attempt's ranks on this node: a batch of that many requests is complete."""
        run = self.state.run(attempt_id)
        return 0 if run is None else run.spec.nproc_per_node


def _without_ranks(report: AttemptStatusReport | None) -> AttemptStatusReport | None:
    """What makes a report new: not its rank summary, nor its ages (which grow at every look), only
    whether it has them (the report that first says the ranks are initialised goes out at once)."""
    if report is None:
        return None
    return report.model_copy(update={
        "ranks": None,
        "received_s_ago": None if report.received_s_ago is None else 0.0,
        "initialized_s_ago": None if report.initialized_s_ago is None else 0.0,
    })
