"""In-process restart: a rank whose peer failed leaves the broken group and joins the next attempt.

    from worker_runtime import run_restartable

    def train(loop):                         # the body a script writes inside ``with TrainLoop``
        model = loop.register("model", build_model())
        ...
        for step, batch in loop.steps(data): ...
        loop.result(...)

    run_restartable(train, total_steps=1000)

``run_restartable`` runs ``train`` in a TrainLoop; ``restartable(attempt)`` is the loop under it, for
a script with its own training loop (worker_runtime/examples/tiny_gpt.py ``--restartable``): it runs
``attempt(ctx, memory)``, one attempt of this rank. When a collective fails because a peer went away
(a gloo/NCCL error, not the script's own bug), the process does not exit: it keeps the error's
traceback in its log, aborts the process group, and asks its own agent, with the fencing token of
the attempt it belonged to, for its part of the next attempt (AgentAssignments; the
``next-assignment`` kind of the local API). Given one, it adopts the new attempt id, token, ranks
and restore plan, joins the new attempt's fenced rendezvous (distributed.fenced_store) and runs
the attempt again: the interpreter, torch and the CUDA context survive, and the restore reads this
rank's own in-memory copy of the planned step (KeptSave) when it holds exactly that step for
exactly this rank, and storage otherwise. Without an assignment (no handover, an agent that does
not offer one, the wait timed out) the original error is raised, as without this wrapper, and the
agent starts the next attempt's part cold. docs/architecture.md, "In-process restart".
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any, Protocol, TypeVar
from urllib.parse import quote

import httpx
import torch.distributed as dist

from trainyard.protocol.env import LOCAL_API_PREFIX
from trainyard.protocol.exits import is_collective_failure
from trainyard.protocol.restart import NEXT_ASSIGNMENT, Assignment, LocalNextAssignment, NextAssignmentAnswer
from worker_runtime.agent_http import agent_client
from worker_runtime.checkpoint.kept import KeptSave
from worker_runtime.context import WorkerContext
from worker_runtime.distributed import StaleRendezvousError, abort_distributed
from worker_runtime.loop import TrainLoop

log = logging.getLogger(__name__)
T = TypeVar("T")

HANDOVER_WAIT_S = 120.0
"""How long a parked rank waits for its agent's answer before it gives up and exits (the agent then
starts the next attempt's part cold)."""


class AssignmentSource(Protocol):
    def next_assignment(self, ctx: WorkerContext, wait_s: float) -> Assignment | None:
        """This worker's part of the attempt after ``ctx``'s, or None (no handover: exit)."""
        ...


class AgentAssignments:
    """Asks the worker's own agent (its local API, with the old attempt's token) for the next part."""

    def __init__(self, *, poll_s: float = 20.0) -> None:
        self.poll_s = poll_s

    def next_assignment(self, ctx: WorkerContext, wait_s: float) -> Assignment | None:
        if not ctx.managed:
            return None
        url = f"{ctx.agent_url}{LOCAL_API_PREFIX}/attempts/{quote(ctx.attempt_id, safe='')}/{NEXT_ASSIGNMENT}"
        deadline = time.monotonic() + wait_s
        with agent_client(ctx, timeout=self.poll_s + 10.0) as client:
            while (left := deadline - time.monotonic()) > 0:
                body = LocalNextAssignment(fencing_token=ctx.fencing_token, rank=ctx.rank,
                                           wait_s=min(self.poll_s, left)).model_dump()
                try:
                    response = client.post(url, json=body)
                except httpx.HTTPError as exc:
                    log.warning("asking the agent for the next assignment failed: %r", exc)
                    time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
                    continue
                if response.status_code != 200:
                    # 404: an agent that offers no handover; 409: this attempt is stale to it.
                    log.info("no handover from the agent (%d)", response.status_code)
                    return None
                answer = NextAssignmentAnswer.model_validate_json(response.content)
                if answer.state == "assigned":
                    return answer.assignment
                if answer.state == "stop":
                    log.info("no handover: %s", answer.reason or "the agent said stop")
                    return None
        return None


def is_peer_failure(exc: BaseException) -> bool:
    """A failure a healthy rank survives by restarting in place: a collective or the rendezvous
    failed (a peer went away, timed out). Never the script's own errors, never a refused rendezvous."""
    if isinstance(exc, StaleRendezvousError):
        return False
    if isinstance(exc, dist.DistError):
        return True
    return isinstance(exc, RuntimeError) and is_collective_failure(str(exc))


def context_for(ctx: WorkerContext, assignment: Assignment) -> WorkerContext:
    """``ctx`` as a rank of ``assignment``'s attempt: same process, GPUs and local rank, the new
    attempt's id, token, ranks, restore plan and rendezvous (never torchrun's environment)."""
    return dataclasses.replace(
        ctx,
        attempt_id=assignment.attempt_id,
        attempt_number=assignment.attempt_number,
        fencing_token=assignment.fencing_token,
        rank=assignment.rank,
        world_size=assignment.world_size,
        node_rank=assignment.node_rank,
        group_rank=assignment.node_rank,
        restore_from=assignment.restore_from,
        rendezvous=assignment.rendezvous,
        agent_socket=assignment.agent_socket or ctx.agent_socket,
    )


def restartable(attempt: Callable[[WorkerContext, KeptSave], T], *, assignments: AssignmentSource | None = None,
                handover_wait_s: float = HANDOVER_WAIT_S, ctx: WorkerContext | None = None) -> T:
    """Run ``attempt(ctx, memory)``, one attempt of this rank, again in this process for each next
    attempt this rank is handed after a peer failure (module docstring); what the attempt that
    completes returns.

    ``attempt`` joins the attempt's process group itself (init_distributed on the ``ctx`` it is given:
    the new attempt's rendezvous after a restart), restores through a CheckpointManager given
    ``memory`` (this process's copy of its last save, kept across attempts), and destroys the group
    only when it returns: on a peer failure this loop aborts the group once the error's frames (and
    the DDP modules they hold) are gone. Any other error, or no handover, ends the process as it
    would without this loop.
    """
    source = assignments or AgentAssignments()
    ctx = ctx or WorkerContext.from_env()
    memory = KeptSave()
    while True:
        try:
            return attempt(ctx, memory)
        except Exception as exc:
            if not is_peer_failure(exc):
                raise
            # The worker's own words stay in its log; the traceback is dropped so that the frames
            # holding the script's DDP wrappers go before the group is aborted.
            traceback.print_exc()
            error = exc.with_traceback(None)
            error.__context__ = error.__cause__ = None
        abort_distributed()
        print(f"trainyard: a peer of attempt {ctx.attempt_id} failed ({type(error).__name__}); "
              "waiting for this rank's part of the next attempt", file=sys.stderr, flush=True)
        assignment = source.next_assignment(ctx, handover_wait_s)
        if assignment is None or assignment.attempt_id == ctx.attempt_id:
            raise error
        ctx = context_for(ctx, assignment)
        print(f"trainyard: restarting in process as rank {ctx.rank}/{ctx.world_size} of attempt {ctx.attempt_id}",
              file=sys.stderr, flush=True)


def run_restartable(train: Callable[[Any], T], *, assignments: AssignmentSource | None = None,
                    handover_wait_s: float = HANDOVER_WAIT_S, ctx: WorkerContext | None = None,
                    **loop_options: Any) -> T:
    """Run ``train(loop)`` in a TrainLoop (``loop_options``: its keyword arguments), restarting it in
    this process for each next attempt this rank is handed after a peer failure (``restartable``).
    Returns what ``train`` returns in the attempt that completes."""
    attempts = 0

    def one_attempt(ctx: WorkerContext, memory: KeptSave) -> T:
        nonlocal attempts
        restarts, attempts = attempts, attempts + 1
        # The loop joins the group on entry, and leaves it to ``restartable`` on a peer failure (its
        # DDP wrappers are still referenced by the error's frames then: TrainLoop._shutdown).
        with TrainLoop(ctx=ctx, memory=memory, **loop_options) as loop:
            loop.restarts = restarts
            return train(loop)

    return restartable(one_attempt, assignments=assignments, handover_wait_s=handover_wait_s, ctx=ctx)
