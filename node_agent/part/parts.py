"""This node's attempt parts as the agent sets them up (``Parts``): their directories, their
confinement (a uid and a cgroup, confinement/isolation.py), their local API socket; starting them
(a Part, with the command lines of commands.py), taking parked ones over, taking back the
parts a previous agent left, and cleaning up after them.

Every launch failure becomes the part's exit with the reason (Part.failed): the control plane
then fails the attempt at once instead of waiting for a part that never runs.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

from node_agent.config import AgentConfig
from node_agent.confinement import processes
from node_agent.confinement.interpreters import interpreter_problem
from node_agent.confinement.isolation import Confinement, Isolation, IsolationError, private_dir, remove_worker_dir
from node_agent.local.api import LocalApi
from node_agent.memtier.tier import AttemptMemory
from node_agent.part.attempt import Part
from node_agent.part.code import ShippedCode
from node_agent.part.commands import AttemptPaths, NodeContext
from node_agent.part.envs import EnvCache
from trainyard.protocol.agent import AgentErrorKind, GpuInfo, LaunchSpec
from trainyard.protocol.env import MAX_JOB_ENV_BYTES, job_env_bytes, job_env_problem
from trainyard.protocol.requirements import requirements_problem

# Attempt ids name directories: nothing that could climb out of work_dir/attempts.
SAFE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class Parts:
    """Sets up, starts, takes over, adopts and finishes this node's attempt parts."""

    def __init__(self, config: AgentConfig, api: LocalApi, isolation: Isolation, log: Any) -> None:
        self.config = config
        self.api = api
        self.isolation = isolation
        self.log = log
        self.attempts_dir = private_dir(config.work_dir / "attempts")
        self.sockets_dir = private_dir(config.runtime_dir / "sockets", 0o711)
        private_dir(config.work_dir / "code")  # every tenant's code archives: root's alone (node_agent/part/code.py)
        self.envs = EnvCache(config.work_dir / "envs", constraints_file=config.pip_constraints,
                             max_count=config.env_cache_max_count, max_bytes=int(config.env_cache_max_gb * 2**30),
                             build_timeout_s=config.env_build_timeout_s)

    def paths(self, attempt_id: str, node_rank: int) -> AttemptPaths:
        name = f"{attempt_id}.{node_rank}"
        return AttemptPaths(self.attempts_dir / attempt_id, self.config.workers_dir / name,
                            self.sockets_dir / f"{name}.sock")

    def problem(self, spec: LaunchSpec, gpus: list[GpuInfo]) -> str | None:
        """Why this node cannot run ``spec``, or None."""
        indices = {gpu.index for gpu in gpus}
        if not set(spec.gpu_indices) <= indices:
            return f"GPU indices {spec.gpu_indices} are not all on this node (it has {sorted(indices)})"
        if spec.nproc_per_node < 1 or spec.nnodes < 1 or not 0 <= spec.node_rank < spec.nnodes:
            return (
                f"invalid shape: node_rank {spec.node_rank} of {spec.nnodes} nodes, "
                f"{spec.nproc_per_node} processes per node"
            )
        # The control plane refuses these at submit; a spec from elsewhere is refused here too.
        if spec.command and (spec.restartable or spec.adopts):
            # A command job's processes are its own launcher's: none is parked or handed over.
            return "a command job cannot restart in process (restartable)"
        env_problems = [p for name, value in spec.env.items() if (p := job_env_problem(name, value))]
        if env_problems:
            return f"the job's env is refused: {'; '.join(env_problems[:5])}"
        if job_env_bytes(spec.env) > MAX_JOB_ENV_BYTES:
            return f"the job's env is {job_env_bytes(spec.env)} bytes, over the {MAX_JOB_ENV_BYTES} an agent accepts"
        work_dir = self.config.work_dir
        try:
            free = shutil.disk_usage(work_dir).free
        except OSError as exc:
            return f"the work dir {work_dir} cannot be read: {exc}"
        if free < self.config.min_free_mb * 2**20:
            return (f"no space left on device: the work dir {work_dir} has {free // 2**20} MiB free, "
                    f"an attempt needs at least {self.config.min_free_mb} MiB (logs, rank status, state)")
        return None

    def interpreter_refusal(self, spec: LaunchSpec) -> str | None:
        """Why the job's own ``python`` may not run here (node_agent/confinement/interpreters.py), or None. Not a
        fault of this node's: the same job would be refused again, so it is a start_error (the job
        fails at once, no retry)."""
        if spec.python is None:
            return None
        return interpreter_problem(spec.python, (str(p) for p in self.config.allowed_pythons))

    def requirements_refusal(self, spec: LaunchSpec) -> str | None:
        """Why the job's requirements may not be installed here (trainyard/protocol/requirements.py),
        or None. Refused at submit already; a spec from elsewhere is refused here too, as a
        start_error: the same requirements would be refused on every node."""
        if spec.requirements is None or (refused := requirements_problem(spec.requirements)) is None:
            return None
        return f"the job's requirements are refused: {refused}"

    def start(self, spec: LaunchSpec, node: NodeContext, gpus: list[GpuInfo], *,
              code: ShippedCode | None = None) -> Part | None:
        """Launch ``spec`` (or record why it cannot run); None when it was launched here before.
        ``code``: the job's shipped code (fetched and unpacked in the part's own thread)."""
        paths = self.paths(spec.attempt_id, spec.node_rank)
        grace = self.config.stop_grace_s
        if not SAFE_ID.match(spec.attempt_id):
            self.log.error("attempt_id_rejected", attempt_id=spec.attempt_id)
            return Part.failed(spec, paths, "attempt id not usable as a directory name on this node",
                                     stop_grace_s=grace, create_dir=False)
        kind: AgentErrorKind | None = None
        try:
            problem = self.problem(spec, gpus)
            if problem is None and (problem := self.requirements_refusal(spec) or self.interpreter_refusal(spec)):
                kind = "start_error"
        except OSError as exc:
            problem = f"could not check the node for this attempt: {exc}"
        if problem is not None:
            self.log.error("attempt_not_runnable", attempt_id=spec.attempt_id, problem=problem)
            try:
                return Part.failed(spec, paths, problem, stop_grace_s=grace, error_kind=kind)
            except OSError:
                return Part.failed(spec, paths, problem, stop_grace_s=grace, create_dir=False, error_kind=kind)
        confinement = Confinement()
        try:
            confinement = self.isolation.confine(node.node_id or None, spec.attempt_id, spec.node_rank,
                                                 processes.uids_alive, gpus=len(spec.gpu_indices))
            self.api.open(spec.attempt_id, paths.socket or Path(), uid=confinement.uid, gid=confinement.gid,
                          ranks=spec.nproc_per_node, memory=AttemptMemory.of(spec.job_id, spec.memory))
        except (IsolationError, OSError) as exc:
            reason = f"could not confine the attempt on this node: {exc}"
        else:
            try:
                return Part.launch(spec, node, paths, stop_grace_s=grace, confinement=confinement,
                                         code=code, envs=self.envs)
            except FileExistsError:
                if paths.root.is_dir():
                    # Launched here before (adoption missed it): never launched twice.
                    self.log.warning("attempt_dir_exists_not_relaunching", attempt_id=spec.attempt_id)
                    self._undo(spec.attempt_id, confinement)
                    return None
                reason = f"could not create the attempt directory {paths.root}: something else is there"
            except OSError as exc:
                reason = f"could not create the attempt directory {paths.root}: {exc}"
        self._undo(spec.attempt_id, confinement)
        self.log.error("attempt_launch_failed", attempt_id=spec.attempt_id, error=reason)
        return Part.failed(spec, paths, reason, stop_grace_s=grace, create_dir=False)

    def take_over(self, spec: LaunchSpec, old: Part) -> Part | None:
        """``spec``'s part made of ``old``'s parked processes (Part.take_over), served on a socket
        of its own for the same uid; None when that cannot be done (the caller starts it cold)."""
        paths = self.paths(spec.attempt_id, spec.node_rank)
        if not SAFE_ID.match(spec.attempt_id) or set(spec.gpu_indices) != set(old.spec.gpu_indices):
            return None
        try:
            # The same memory tier as a cold start of the part (its saves kept here and pushed to its peer).
            self.api.open(spec.attempt_id, paths.socket or Path(), uid=old.confinement.uid, gid=old.confinement.gid,
                          ranks=spec.nproc_per_node, memory=AttemptMemory.of(spec.job_id, spec.memory))
            return Part.take_over(spec, paths, old)
        except OSError as exc:
            self.api.close(spec.attempt_id)
            self.log.error("attempt_take_over_failed", attempt_id=spec.attempt_id, error=str(exc))
            return None

    def _undo(self, attempt_id: str, confinement: Confinement) -> None:
        self.api.close(attempt_id)
        self.isolation.release(confinement)

    def adopt_all(self) -> tuple[set[str], list[Part]]:
        """The attempts a previous agent left in work_dir: every id found (never launched again)
        and those still to report or stop. Their sockets are served again; worker directories of
        any other attempt are removed (their uid may be another attempt's by now)."""
        seen: set[str] = set()
        runs: list[Part] = []
        for root in sorted(self.attempts_dir.iterdir()):
            if not root.is_dir():
                continue
            seen.add(root.name)
            state_paths = AttemptPaths(root, root / "worker")
            run = Part.adopt(state_paths, stop_grace_s=self.config.stop_grace_s, isolation=self.isolation)
            if run is None:
                continue
            runs.append(run)
            if run.env_key is not None and run.alive:
                self.envs.hold(run.env_key)  # not evicted under its workers
            if run.paths.socket is not None and run.alive:
                try:
                    self.api.open(run.attempt_id, run.paths.socket, uid=run.confinement.uid, gid=run.confinement.gid,
                                  ranks=run.spec.nproc_per_node,
                                  memory=AttemptMemory.of(run.spec.job_id, run.spec.memory))
                except OSError as exc:
                    run.log.error("local_api_socket_failed", error=str(exc))
        kept = {run.paths.worker.name for run in runs}
        workers_dir = self.config.workers_dir
        if workers_dir.is_dir():
            for entry in os.scandir(workers_dir):
                if entry.name not in kept:
                    remove_worker_dir(Path(entry.path))
        return seen, runs

    def finish(self, run: Part) -> None:
        """The part is done and none of its processes is left: stop serving it, give its uid and
        cgroup back, and remove its worker directory (its logs have been shipped)."""
        self.api.close(run.attempt_id)
        for earlier in run.handed_over_from():
            self.api.close(earlier)  # its workers' earlier sockets (a chain of handovers)
        if run.env_key is not None:
            self.envs.release(run.env_key)
            run.env_key = None
        removed = self.isolation.release(run.confinement)
        if removed:
            run.log.info("worker_uid_files_removed", paths=removed[:20], count=len(removed))
        if not run.in_memory and run.paths.worker.parent == self.config.workers_dir:
            remove_worker_dir(run.paths.worker)
