"""This node's part of one attempt: its processes, its status report, its log tailer.

Lifecycle of a Part (all transitions happen in `poll`, `request_stop` or at launch):

    launched --torchrun exits--> torchrun_done --group empty--> finished --final report acked
    and logs drained--> done

`alive` (any process of the attempt left) is what heartbeats report; the control plane frees the
attempt's GPUs only once it turns false, so it must not turn false early: it covers torchrun, every
process of its group, and rank-file workers that left the group.

state.json in the attempt directory lets a restarted agent re-adopt the attempt; because the
directory exists, the attempt is never launched again on this node.

Which processes are the attempt's: those of its cgroup when it has one, else those of its uid when
it runs as one of its own (isolation.py), else those carrying its markers (processes.py). Only the
last can be escaped, and only by a worker running as the agent's own user.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import structlog
from pydantic import ValidationError

from node_agent.confinement import processes, safe_files
from node_agent.confinement.isolation import Confinement, Isolation, hidden_paths, make_worker_dir
from node_agent.confinement.part_limits import WALK_BACKOFF, WORK_DIR_CHECK_S, PartLimiter
from node_agent.part.code import CodeUnavailable, ShippedCode, unpack
from node_agent.part.commands import AttemptPaths, NodeContext, start_torchrun
from node_agent.part.envs import EnvBuildFailed, EnvCache, kill_build
from node_agent.part.logs import LogTailer
from node_agent.ranks.torchrun_entry import LAUNCHER_FILE
from trainyard.protocol.agent import (
    AgentErrorKind,
    AttemptStatusReport,
    LaunchSpec,
    NodeAttemptState,
    Progress,
    RankSummary,
    WorkerState,
    WorkerStatus,
)

log = structlog.get_logger(__name__)
ERROR_TAIL_BYTES = 2000
RANK_FILE_BYTES = 64 * 1024
LAUNCHER_FILE_BYTES = 512
"""launcher.json is three pids: anything larger is not the stand-in's."""
_RANK_FILE = re.compile(r"^rank-\d{1,9}\.json$")


class Part:
    def __init__(
        self, spec: LaunchSpec, paths: AttemptPaths, *, stop_grace_s: float, confinement: Confinement | None = None
    ) -> None:
        self.spec = spec
        self.paths = paths
        self.stop_grace_s = stop_grace_s
        self.confinement = confinement or Confinement()
        self.log = log.bind(attempt_id=spec.attempt_id, job_id=spec.job_id, node_rank=spec.node_rank)
        self.tailer = LogTailer(paths.log_dir, owner=self.confinement.uid)
        self._lock = threading.RLock()
        self._proc: subprocess.Popen[bytes] | None = None
        self.pid: int | None = None
        self.pgid: int | None = None
        self.create_time: float | None = None
        self.boot_id: str | None = None
        """pid, pgid and create_time identify torchrun only within this boot."""
        self.adopted = False
        self.in_memory = False
        """No directory of its own (it could not be made): nothing is written for it."""
        self.exit_code: int | None = None
        self.torchrun_done = False
        self.alive = True
        self.error: str | None = None
        self.error_kind: AgentErrorKind | None = None
        """start_error when the job's own setup cannot work here (its requirements do not install)."""
        self.preparing = False
        """Its code is being fetched and unpacked, or its requirements' venv built (in a thread of its
        own): no torchrun yet."""
        self._unpacking: subprocess.Popen[bytes] | None = None
        """The process unpacking its code (as its uid), while it runs: a stop kills it."""
        self._building = False
        """Its venv is being probed or built as its uid, in its cgroup (or it waits for another's
        build): a stop kills the build's processes, and the part stays alive (its uid leased) until
        the build has returned."""
        self.env_key: str | None = None
        """The cached venv it runs in (held until it is done: node_agent/part/envs.py)."""
        self.stop_reason: str | None = None
        self.stopped = False
        """torchrun ended after the agent asked it to stop (state 'stopped', not 'exited')."""
        self._term_sent_at: float | None = None
        self._kill_sent = False
        self._torchrun_killed = False
        self._workers: list[WorkerStatus] = []
        self._members: set[int] = set()
        self._pgids: set[int] = set()
        self._seen: set[tuple[int, float | None]] = set()
        # Reporting state, owned by the agent's reporter loop.
        self.stale = False
        self.final_acked = False
        self.done = False
        self.logs_closed = False
        """Fenced off (stale): every byte of its logs was shipped, or the control plane refused them.
        Until then its last lines still go (a superseded attempt's logs are accepted under its own
        token), and its worker directory, which holds them, is kept."""
        self.logs_deadline: float | None = None
        """Fenced off and ended: when the agent stops waiting for its last log lines to go out."""
        self.last_report: AttemptStatusReport | None = None
        self.last_sent_at = 0.0
        self.next_try_at = 0.0
        # In-process restart (node_agent/local/handover.py): a restartable part told to stop while its
        # workers are all alive is parked; a part of the next attempt may then take its processes over.
        self.parked = False
        """Told to stop, its workers kept alive for a handover (reported ``parked``)."""
        self.parked_until: float | None = None
        """While parked, the handover's deadline (wall clock, saved in state.json: an agent restarted
        keeps the part parked until then, never longer, and a takeover meanwhile finds it parked)."""
        self.marker: tuple[str, int] | None = None
        """(attempt id, node rank) its processes carry in their environment, when they were started
        for an earlier attempt whose part this one took over; None: its own."""
        self.adopted_from: dict[str, Any] | None = None
        """The taken-over part: its attempt id, torchrun (pid, start time, boot id) and worker dir."""
        self.received_at: float | None = None
        """When this agent received the part (its monotonic clock; None: adopted after a restart)."""
        self.limit_hit: str | None = None
        """The resource limit the part hit (its failure reason; issue 23, finding 6)."""
        self._work_dir_checked_at = 0.0
        """When its work directory may be walked again (node_agent/confinement/part_limits.py)."""

    @property
    def attempt_id(self) -> str:
        return self.spec.attempt_id

    @property
    def local_workers(self) -> int:
        """The worker records this part has: one per local rank under torchrun; one for a ``command``
        job's whole part (its command under one rank shim: node_agent/part/commands.py, command_argv)."""
        return 1 if self.spec.command else self.spec.nproc_per_node

    @property
    def started_as(self) -> tuple[str, int]:
        """(attempt id, node rank) its processes were started with (their markers, rank files)."""
        return self.marker or (self.spec.attempt_id, self.spec.node_rank)

    def handed_over_from(self) -> list[str]:
        """The attempts whose parts handed these processes over to this one, oldest first."""
        if self.adopted_from is None:
            return []
        earlier = self.adopted_from.get("earlier")
        chain = [a for a in earlier if isinstance(a, str)] if isinstance(earlier, list) else []
        return [*chain, str(self.adopted_from.get("attempt_id"))]

    def set_parked(self, until: float | None) -> None:
        """Parked until ``until`` (time.time()), or no longer (None); saved at once."""
        self.parked, self.parked_until = until is not None, until
        self._persist()

    def parkable(self) -> bool:
        """A restartable part whose every worker runs: it can wait for a handover instead of stopping."""
        with self._lock:
            if not self.spec.restartable or self.torchrun_done or not self.alive or self.preparing:
                return False
            if self.stop_reason is not None:
                return False
            running = [w for w in self._workers if w.state == WorkerState.running]
            return len(running) == self.local_workers

    @classmethod
    def take_over(cls, spec: LaunchSpec, paths: AttemptPaths, old: Part) -> Part:
        """``spec``'s part made of ``old``'s parked processes (docs/architecture.md, "In-process
        restart"): the same torchrun, uid, cgroup and worker directory (status files, logs), its own
        attempt directory (``paths.root``, whose state.json records what it adopted) and socket.
        ``old`` is handed over: never reported, stopped or finished again. Raises FileExistsError
        like ``launch``."""
        paths.root.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        paths.root.mkdir(mode=0o700, exist_ok=False)
        run = cls(spec, AttemptPaths(paths.root, old.paths.worker, paths.socket), stop_grace_s=old.stop_grace_s,
                  confinement=old.confinement)
        with old._lock:
            run._proc, run.pid, run.pgid = old._proc, old.pid, old.pgid
            run.create_time, run.boot_id, run.adopted = old.create_time, old.boot_id, old.adopted
            run._members, run._pgids, run._seen = set(old._members), set(old._pgids), set(old._seen)
            run._workers = list(old._workers)
            run.tailer = old.tailer  # its logs go on from where they were shipped, as the new attempt's
            run.env_key, old.env_key = old.env_key, None
            run.marker = old.started_as
            # Each attempt in a chain of handovers (1 -> 2 -> 3) left these processes a socket and a
            # handover entry; the last part closes them all when it finishes.
            run.adopted_from = {"attempt_id": old.attempt_id, "pid": old.pid, "create_time": old.create_time,
                                "boot_id": old.boot_id, "worker_dir": str(old.paths.worker),
                                "earlier": old.handed_over_from()}
            old.parked, old.parked_until = False, None
            old.done = True  # its processes are the new part's now; its record says where they went
            old._persist(handed_over_to=spec.attempt_id)
        run._persist()
        run.log.info("attempt_taken_over", from_attempt=old.attempt_id, pid=run.pid)
        return run

    # --- creation ---

    @classmethod
    def launch(
        cls, spec: LaunchSpec, node: NodeContext, paths: AttemptPaths, *, stop_grace_s: float,
        confinement: Confinement | None = None, code: ShippedCode | None = None, envs: EnvCache | None = None,
    ) -> Part:
        """Create the attempt's directories and start torchrun (confined as ``confinement`` says).
        A job with shipped code (``code``) gets it fetched and unpacked into the worker directory
        first (the workers then run there, as the attempt's uid), and a job with requirements its
        venv from ``envs``: both in a thread of the part's own, since either may take minutes, and
        meanwhile the part is launching (reported, stoppable) and the agent's loops go on. Raises
        FileExistsError if the attempt directory exists: that attempt has been launched here before
        and must never be launched again."""
        paths.root.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        paths.root.mkdir(mode=0o700, exist_ok=False)
        run = cls(spec, paths, stop_grace_s=stop_grace_s, confinement=confinement)
        run._persist()  # before starting: a crash in between must still leave the id taken
        try:
            make_worker_dir(paths.worker, run.confinement.uid, run.confinement.gid)
            if spec.python is not None:
                node = dataclasses.replace(node, python=spec.python)
            if code is not None:
                run.preparing = True
                threading.Thread(target=run._unpack_then_start, args=(code, envs, node),
                                 name=f"code-{spec.attempt_id}", daemon=True).start()
                return run
            if spec.requirements is not None and envs is not None:
                run.preparing = True
                threading.Thread(target=run._prepare_then_start, args=(envs, node, None),
                                 name=f"env-{spec.attempt_id}", daemon=True).start()
                return run
            proc = start_torchrun(spec, node, paths, run.confinement, cwd=None)
        except OSError as exc:
            run.log.error("launch_failed", error=str(exc))
            run.error = f"could not start torchrun: {exc}"
            run.torchrun_done, run.alive = True, False
            run._persist()
            return run
        run._started(proc)
        return run

    def _started(self, proc: subprocess.Popen[bytes]) -> None:
        self._proc, self.pid, self.pgid = proc, proc.pid, proc.pid
        self.create_time = processes.process_create_time(proc.pid)
        self.boot_id = processes.boot_id()
        self._persist()
        self.log.info("attempt_launched", pid=proc.pid, nnodes=self.spec.nnodes,
                      nproc_per_node=self.spec.nproc_per_node)

    # --- shipped code (docs/security.md, "Shipped code") ---

    def _unpack_then_start(self, code: ShippedCode, envs: EnvCache | None, node: NodeContext) -> None:
        """In the part's own thread: fetch the job's code into the node's cache, unpack it as the
        part's uid into its worker directory, then go on as a part without code would (its venv,
        torchrun). An archive over this node's caps fails the job at once (start_error)."""
        started = time.monotonic()
        into = self.paths.worker / "code"
        try:
            archive = code.archive()
            cwd = unpack(archive, into, confinement=self.confinement, limits=code.limits,
                         started=self._unpack_started)
        except CodeUnavailable as exc:
            self.log.error("code_unpack_failed", error=str(exc), permanent=exc.permanent)
            with self._lock:
                self._unpacking, self.preparing = None, False
                if self.stop_reason is None:
                    self.error, self.error_kind = str(exc), "start_error" if exc.permanent else None
                    self.torchrun_done, self.alive = True, False
                    self._persist()
            return
        except Exception as exc:  # never a part left launching for ever
            self.log.exception("code_unpack_crashed")
            with self._lock:
                self._unpacking, self.preparing = None, False
                if self.stop_reason is None:
                    self.error = f"could not prepare the job's code: {exc}"
                    self.torchrun_done, self.alive = True, False
                    self._persist()
            return
        self.log.info("code_ready", seconds=round(time.monotonic() - started, 2))
        node = dataclasses.replace(node, cwd=str(cwd))
        with self._lock:
            self._unpacking = None
            if self.stop_reason is not None:
                self.preparing = False
                return
        if self.spec.requirements is not None and envs is not None:
            self._prepare_then_start(envs, node, cwd)
            return
        with self._lock:
            self.preparing = False
            if self.stop_reason is not None:
                return
            self._start_locked(node, cwd)

    def _start_locked(self, node: NodeContext, cwd: Path | None) -> None:
        """Start torchrun (the caller holds the lock), or record why it could not start."""
        try:
            proc = start_torchrun(self.spec, node, self.paths, self.confinement, cwd=cwd)
        except OSError as exc:
            self.log.error("launch_failed", error=str(exc))
            self.error = f"could not start torchrun: {exc}"
            self.torchrun_done, self.alive = True, False
            self._persist()
            return
        self._started(proc)

    def _unpack_started(self, proc: subprocess.Popen[bytes]) -> None:
        with self._lock:
            self._unpacking = proc
            if self.stop_reason is not None:
                proc.kill()  # stopped before it began

    def _prepare_then_start(self, envs: EnvCache, node: NodeContext, cwd: Path | None) -> None:
        assert self.spec.requirements is not None
        started = time.monotonic()
        with self._lock:
            if self.stop_reason is not None:
                self.preparing = False
                return
            self._building = True
        try:
            key, python = envs.acquire(self.spec.requirements, node.python, self._builder(node),
                                       cancelled=lambda: self.stop_reason is not None)
        except EnvBuildFailed as exc:
            self.log.error("requirements_failed", error=str(exc))
            with self._lock:
                self.preparing = self._building = False
                if self.stop_reason is None:
                    self.error, self.error_kind = str(exc), "start_error"
                self.torchrun_done, self.alive = True, False
                self._persist()
            return
        except Exception as exc:  # never a part left launching for ever
            self.log.exception("requirements_env_failed")
            with self._lock:
                self.preparing = self._building = False
                if self.stop_reason is None:
                    self.error = f"could not prepare the job's requirements: {exc}"
                self.torchrun_done, self.alive = True, False
                self._persist()
            return
        with self._lock:
            self.preparing = self._building = False
            if self.stop_reason is not None:  # stopped meanwhile: nothing to start
                envs.release(key)
                self.torchrun_done, self.alive = True, False
                self._persist()
                return
            self.env_key = key
            self.log.info("requirements_ready", env=key[:12], seconds=round(time.monotonic() - started, 2))
            if self.confinement.uid is not None:
                # The venv may sit below a directory its uid cannot enter (a private work dir's
                # parent): exposed read-only in the part's mount namespace, as the interpreter is.
                hidden = hidden_paths([str(Path(python).parent.parent)])
                self.confinement.expose = tuple(dict.fromkeys((*self.confinement.expose, *hidden)))
            self._start_locked(dataclasses.replace(node, python=python), cwd)

    def _builder(self, node: NodeContext) -> Confinement | None:
        """Who probes ``node.python`` and builds the venv: the part's own uid (never root), in its
        cgroup, seeing what its workers will see; None: the agent itself (no uid pool). An
        installation below a private directory is exposed only when it is the agent's own (in the
        part's ``expose`` already) or one the operator listed (``--allowed-python``): a job naming
        a root-owned /root/x/bin/tool must not get /root/x shown to its uid."""
        confinement = self.confinement
        if confinement.uid is None:
            return None
        python = node.python
        listed = {os.path.normpath(p) for p in node.allowed_pythons}
        installations = []
        if os.path.normpath(python) in listed:
            # The installation as named (a venv's) and as its links resolve (the base interpreter's).
            installations = [os.path.dirname(os.path.dirname(p)) for p in (python, os.path.realpath(python))]
        expose = tuple(dict.fromkeys((*confinement.expose, *hidden_paths(installations))))
        # Everything else of the part's confinement (its cgroup, and whatever limits it carries) as is.
        return dataclasses.replace(confinement, expose=expose, lease=None)

    @classmethod
    def failed(
        cls, spec: LaunchSpec, paths: AttemptPaths, error: str, *, stop_grace_s: float, create_dir: bool = True,
        error_kind: AgentErrorKind | None = None,
    ) -> Part:
        """An assigned attempt this node cannot run (reported as exited with `error`, of `error_kind`
        when known: start_error is never retried). Without `create_dir` (the directory cannot be
        made, or must not be touched) it lives in memory only: it is still reported, once per agent
        life."""
        if create_dir:
            paths.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        run = cls(spec, paths, stop_grace_s=stop_grace_s)
        run.in_memory = not create_dir
        run.error, run.error_kind, run.torchrun_done, run.alive = error, error_kind, True, False
        run._persist()
        return run

    @classmethod
    def adopt(
        cls, paths: AttemptPaths, *, stop_grace_s: float, isolation: Isolation | None = None
    ) -> Part | None:
        """The attempt left by a previous agent in this directory, or None when it is done (or its
        state is unreadable: then there is nothing this agent could report or stop)."""
        try:
            state = json.loads(paths.state_file.read_text())
            spec = LaunchSpec.model_validate(state["spec"])
        except (OSError, ValueError, KeyError, ValidationError) as exc:
            log.warning("attempt_state_unreadable", path=str(paths.state_file), error=str(exc))
            return None
        if state.get("done"):
            return None
        worker, socket = state.get("worker_dir"), state.get("socket")
        # No worker_dir: an agent of an earlier version, whose workers wrote status/ and logs/ into
        # the attempt directory itself.
        paths = AttemptPaths(paths.root, Path(worker) if isinstance(worker, str) else paths.root,
                             Path(socket) if isinstance(socket, str) else paths.socket)
        run = cls(spec, paths, stop_grace_s=stop_grace_s, confinement=Confinement.from_state(state))
        if isolation is not None:
            isolation.readopt(run.confinement)  # before the first look at its processes
        run.adopted = True
        run.pid, run.pgid, run.create_time = state.get("pid"), state.get("pgid"), state.get("create_time")
        run.boot_id = state.get("boot_id")
        if run.pid is not None and run.boot_id is not None and run.boot_id != processes.boot_id():
            # The node rebooted: the saved pid and pgid now name unrelated processes, if any.
            run.pgid = run.create_time = None
            if not run.torchrun_done and run.stop_reason is None:
                run.error = run.error or "the node rebooted while the attempt ran"
        run.error, run.stop_reason = state.get("error"), state.get("stop_reason")
        kind, env_key = state.get("error_kind"), state.get("env_key")
        run.error_kind = kind if kind in ("start_error", "launch_error", "resource_limit") else None
        run.env_key = env_key if isinstance(env_key, str) else None
        run.stopped = bool(state.get("stopped"))
        run.exit_code, run.final_acked = state.get("exit_code"), bool(state.get("final_acked"))
        run.torchrun_done = bool(state.get("torchrun_done"))
        marker, adopted_from = state.get("marker"), state.get("adopted_from")
        if isinstance(marker, list) and len(marker) == 2 and isinstance(marker[0], str) and isinstance(marker[1], int):
            run.marker = (marker[0], marker[1])
        run.adopted_from = adopted_from if isinstance(adopted_from, dict) else None
        parked_until = state.get("parked_until")
        if isinstance(parked_until, (int, float)) and run.stop_reason is None and run.spec.restartable:
            run.parked, run.parked_until = True, float(parked_until)
        if run.pid is None:
            run.torchrun_done, run.alive = True, False
            run.error = run.error or "the agent stopped while launching this attempt"
        # A torchrun that ended while no agent watched is seen by poll below, which takes the exit
        # code from the rank shims' files.
        if run.stop_reason is not None:
            run._term_sent_at = time.monotonic()  # resume the escalation to SIGKILL
        run.poll()
        run.log.info("attempt_adopted", pid=run.pid, alive=run.alive, torchrun_done=run.torchrun_done)
        return run

    def _persist(self, **extra: Any) -> None:
        if self.in_memory:
            return
        spec = self.spec.model_dump(mode="json")
        if "secret_key" in spec["storage"]:
            # Only the launch needs it, and an adopted attempt is never launched again.
            spec["storage"]["secret_key"] = "<redacted>"
        state = {
            "spec": spec,
            "pid": self.pid,
            "pgid": self.pgid,
            "create_time": self.create_time,
            "boot_id": self.boot_id,
            "torchrun_done": self.torchrun_done,
            "exit_code": self.exit_code,
            "error": self.error,
            "error_kind": self.error_kind,
            "env_key": self.env_key,
            "stop_reason": self.stop_reason,
            "stopped": self.stopped,
            "final_acked": self.final_acked,
            "done": self.done,
            "worker_dir": str(self.paths.worker),
            "socket": str(self.paths.socket) if self.paths.socket else None,
            "marker": list(self.marker) if self.marker else None,
            "adopted_from": self.adopted_from,
            "parked_until": self.parked_until if self.parked else None,
            **self.confinement.to_state(),
            **extra,
        }
        try:
            # Private: it holds the fencing token, which is the attempt's credential.
            safe_files.write_private_json(self.paths.state_file, state)
        except OSError as exc:
            self.log.error("attempt_state_write_failed", error=str(exc))

    # --- supervision ---

    def _refresh(self, table: processes.ProcessTable) -> bool:
        """Update the set of the attempt's processes from a scan; True if any is left."""
        confinement = self.confinement
        if confinement.cgroup is not None:
            self._members = {pid for pid in confinement.cgroup.pids() if pid in table.started}
            self._members |= {pid for pid in (self.pid,) if pid and table.same_process(pid, self.create_time)}
            return bool(self._members)
        if confinement.owns_uid:
            assert confinement.uid is not None
            self._members = set(table.by_uid.get(confinement.uid, ()))
            return bool(self._members)
        # A group is signalled only while its identity is proven, never by its number alone: after
        # a reboot or a long outage that number may name an unrelated process group.
        attempt_id, node_rank = self.started_as
        members = set(table.by_part.get((attempt_id, str(node_rank)), ()))
        pgids = {table.pgid_of[pid] for pid in members}  # groups of processes carrying our id
        if self.pgid is not None and self.pgid == self.pid and table.same_process(self.pgid, self.create_time):
            pgids.add(self.pgid)  # torchrun's group, while its leader is the torchrun we started
        for pgid in self._pgids - pgids:
            # Seen before, its members carrying our id gone: still ours while a process seen in it
            # before (same pid and start time) is in it; an emptied group's number may be reused.
            if any((pid, table.started.get(pid)) in self._seen for pid in table.by_pgid.get(pgid, ())):
                pgids.add(pgid)
        for pgid in pgids:
            members |= table.by_pgid.get(pgid, set())
        self._pgids = pgids
        self._seen = {(pid, table.started.get(pid)) for pid in members}
        self._members = members
        return bool(members)

    def _signal(self, sig: signal.Signals) -> None:
        if self.confinement.cgroup is not None:
            self.confinement.cgroup.signal(sig)  # SIGKILL: cgroup.kill, every process at once
            processes.signal_processes(self._members, (), sig)
        elif self.confinement.owns_uid:
            processes.signal_processes(self._members, (), sig)  # never a group: only the uid's pids
        else:
            processes.signal_processes(self._members, self._pgids, sig)

    def request_stop(self, reason: str) -> None:
        """SIGTERM now, SIGKILL after the grace period (see poll). Idempotent."""
        with self._lock:
            if self.stop_reason is not None or not self.alive:
                return
            self.stop_reason = reason
            self.log.info("attempt_stopping", reason=reason)
            if self.preparing:
                # Nothing runs yet but the unpacking of its code (killed: its uid is given back
                # once the part is done) or the build of its venv.
                if self._unpacking is not None:
                    self._unpacking.kill()
                    self._unpacking.wait()
                self.stopped, self.torchrun_done = True, True
                if self._building and self.confinement.uid is not None:
                    # Killed (another part wanting the venv builds it again), and the uid kept until
                    # the build has returned: given back while pip or the seal still worked on the
                    # venv it owns, the next part to lease it could change what is sealed as root.
                    kill_build(self.confinement)
                else:
                    self.alive = False
                self._persist()
                return
            self._refresh(processes.scan())
            self._term_sent_at = time.monotonic()
            self._signal(signal.SIGTERM)
            self._persist()

    def kill_now(self) -> None:
        with self._lock:
            if self.alive:
                self._refresh(processes.scan())
                self._kill_sent = True
                self._signal(signal.SIGKILL)

    def poll(self, table: processes.ProcessTable | None = None) -> None:
        """Look at the processes and rank files; escalate a stop that outlived its grace period.
        `table`: a scan shared by all attempts (one is made if not given)."""
        with self._lock:
            if self.preparing:
                return
            self._workers = self._read_rank_files()
            changed = self.alive and self.limit_hit is None and self._check_limits()
            if not self.torchrun_done:
                if self._proc is not None:
                    code = self._proc.poll()
                    if code is not None:
                        self.exit_code, self.torchrun_done, changed = code, True, True
                elif (
                    self.pid is None
                    or self.create_time is None  # no identity: a live pid may be anyone's
                    or not processes.pid_alive(self.pid, self.create_time)
                ):
                    # Not our child (adopted after an agent restart): its exit status is lost, but
                    # every rank's shim wrote its worker's exact exit code.
                    self.torchrun_done, changed = True, True
                    self.exit_code, error = self._exit_from_rank_files()
                    self.error = self.error or error
                if changed:
                    self.stopped = self.stop_reason is not None
                    self.log.info("torchrun_exited", exit_code=self.exit_code, stopped=self.stopped)
            found = self._refresh(processes.scan() if table is None else table)
            alive = found or not self.torchrun_done
            fast_kill = (self.stop_reason is not None and self._term_sent_at is not None and not self._kill_sent
                         and not self._torchrun_killed and not self.torchrun_done and self.pid is not None)
            torchrun = self._torchrun_pids() if fast_kill else set()
            if (fast_kill and self._members <= torchrun
                    # A table shared by the supervise step may predate shims torchrun just started.
                    and (table is None or (self._refresh(processes.scan()) and self._members <= torchrun))):
                # Stopped, and every shim and worker is gone (each had its SIGTERM and its grace):
                # torchrun's own teardown after a SIGTERM (closing its workers again, its error
                # report, a torch interpreter's exit) took about half a second and ends nothing of
                # the job's, while the part's GPUs are released only once it is gone, which a
                # recovery's next attempt waits for (docs/architecture.md, "Recovery").
                self.log.info("torchrun_killed_after_its_workers", pid=self.pid)
                # torchrun alone, and no escalation: anything that starts after this still gets its
                # SIGTERM's grace (_kill_sent means the grace ran out).
                self._torchrun_killed = True
                processes.signal_processes(tuple(sorted(torchrun & (self._members | {self.pid}))), (), signal.SIGKILL)
            if self.torchrun_done and alive and self._term_sent_at is None:
                # torchrun is gone but left processes behind: clean up without calling it a stop.
                self.log.warning("attempt_leftovers", pids=sorted(self._members))
                self._term_sent_at = time.monotonic()
                self._signal(signal.SIGTERM)
            if (
                alive
                and self._term_sent_at is not None
                and (self._kill_sent or time.monotonic() - self._term_sent_at >= self.stop_grace_s)
            ):
                # Repeated while anything is left: a process may fork while it is being killed.
                self._kill_sent = True
                self._signal(signal.SIGKILL)
            if self.alive and not alive:
                self.log.info("attempt_processes_gone", exit_code=self.exit_code, stop_reason=self.stop_reason)
                changed = True
            self.alive = alive
            if changed:
                self._persist()

    def enforce_limits(self) -> None:
        """The limit checks alone (``_check_limits``), for the supervision loop to make before its
        scan of the process table: a fork bomb makes that scan take seconds, and the bomb must not
        have them."""
        with self._lock:
            if self.alive and self.limit_hit is None and not self.preparing and self._check_limits():
                self._persist()

    def _check_limits(self) -> bool:
        """Stop the part, with the limit as its failure reason, once it hit one (its memory, pids,
        /dev/shm or work directory cap: node_agent/confinement/part_limits.py). Also looked at in the poll that
        finds its processes gone, so a limit that ended it is still its reason. True: it hit one."""
        confinement = self.confinement
        if confinement.limits is None:
            return False
        now = time.monotonic()
        walk = now >= self._work_dir_checked_at
        reason = PartLimiter.check(confinement.limits, confinement.limit_groups, confinement.shm_dir,
                                   self.paths.worker if walk else None)
        if walk:
            took = time.monotonic() - now
            self._work_dir_checked_at = now + max(WORK_DIR_CHECK_S, WALK_BACKOFF * took)
        if reason is None:
            return False
        self.limit_hit = self.error = reason
        self.error_kind = "resource_limit"  # the cause, whatever its workers' exits say (they were killed for it)
        self.log.warning("attempt_limit_hit", reason=reason)
        # At once and without a grace: a fork bomb or a filler would use it to go on. With a cgroup,
        # cgroup.kill needs no look at the process table, which a fork bomb makes slow to read.
        if self.confinement.cgroup is None:
            self._refresh(processes.scan())
        self._term_sent_at, self._kill_sent = now, True
        self._signal(signal.SIGKILL)
        return True

    def _exit_from_rank_files(self) -> tuple[int | None, str | None]:
        """torchrun's exit code as its ranks' files tell it: 0 when every local rank exited 0, the
        first failing rank's code otherwise; None (with why) when some rank left no exit."""
        ranks = {w.local_rank: w for w in self._workers}
        exits = [ranks.get(local) for local in range(self.local_workers)]
        failed = [w for w in exits if w is not None and w.state == WorkerState.exited and w.exit_code != 0]
        if failed:
            w = failed[0]
            return 1, f"rank {w.rank} exited with {w.exit_code} (torchrun was not a child of this agent)"
        if all(w is not None and w.state == WorkerState.exited and w.exit_code == 0 for w in exits):
            return 0, None
        missing = [local for local, w in enumerate(exits) if w is None or w.state != WorkerState.exited]
        return None, (
            "torchrun ended while not a child of this agent and local ranks "
            f"{missing} recorded no exit; exit code unknown"
        )

    def watched_pids(self) -> list[int]:
        """The processes whose exit supervision should hear of at once (loops/wake.py): torchrun
        while it runs, then every other process of the attempt the last scan found (the shims, the
        workers and theirs)."""
        with self._lock:
            first = [self.pid] if not self.torchrun_done and self.pid else []
            return first + sorted(self._members - set(first))

    def signature(self) -> tuple[object, ...]:
        """What the control plane would want to hear about at once when it changes: whether any
        process is left (first), torchrun's end, each worker's state."""
        with self._lock:
            return (self.alive, self.torchrun_done, tuple((w.rank, w.state, w.exit_code) for w in self._workers))

    @property
    def finished(self) -> bool:
        """torchrun has exited and no process of the attempt is left."""
        with self._lock:
            return self.torchrun_done and not self.alive

    @property
    def stopping(self) -> bool:
        return self.stop_reason is not None

    def _torchrun_pids(self) -> set[int]:
        """torchrun's process and, when it started warm, the standby it runs in and its own stand-in
        (node_agent/ranks/torchrun_entry.py, LAUNCHER_FILE): written by the job's uid, so only pids
        that are this part's processes count."""
        pids = {self.pid} if self.pid is not None else set()
        try:
            raw = safe_files.read_file(self.paths.worker, "status", LAUNCHER_FILE, limit=LAUNCHER_FILE_BYTES,
                                       owner=self.confinement.uid)
            record = json.loads(raw)
        except Exception:  # noqa: BLE001 - the job's bytes (a nesting that exhausts the parser's recursion)
            return pids
        if not isinstance(record, dict) or record.get("launcher") != self.pid:
            return pids
        return pids | {p for p in (record.get("standby"), record.get("torchrun"))
                       if isinstance(p, int) and not isinstance(p, bool) and p in self._members}

    def _read_rank_files(self) -> list[WorkerStatus]:
        """The rank shims' files, read as a worker could have left them: no link followed, nothing
        but a small regular file of the attempt's uid, and a rank this part can have."""
        workers = []
        world, local = self.spec.nnodes * self.spec.nproc_per_node, self.spec.nproc_per_node
        names = sorted(n for n in safe_files.list_dir(self.paths.worker, "status") if _RANK_FILE.match(n))
        for name in names[: 2 * local + 8]:  # a worker may add names; reading them all is its cost
            try:
                raw = safe_files.read_file(self.paths.worker, "status", name, limit=RANK_FILE_BYTES,
                                           owner=self.confinement.uid)
                status = WorkerStatus.model_validate_json(raw)
            except (OSError, ValidationError):
                continue  # being replaced right now, or garbage: the next poll sees it
            if status.rank < world and status.local_rank < local and name == f"rank-{status.rank}.json":
                workers.append(status)
        return sorted(workers, key=lambda w: w.rank)

    # --- reporting ---

    def report(self, progress: Progress | None, result: dict[str, Any] | None,
               ranks: RankSummary | None = None) -> AttemptStatusReport:
        with self._lock:
            workers = list(self._workers)
            if self.finished:
                # A shim killed with SIGKILL never wrote its end; nothing of that rank is left now.
                workers = [
                    w if w.state == WorkerState.exited else w.model_copy(update={"state": WorkerState.exited})
                    for w in workers
                ]
            if self.marker is not None and self.marker[1] != self.spec.node_rank:
                # Its shims numbered their files in the node rank they started with; the same local
                # ranks are this node rank's now.
                shift = (self.spec.node_rank - self.marker[1]) * self.spec.nproc_per_node
                workers = [w.model_copy(update={"rank": w.rank + shift}) for w in workers]
            if not self.torchrun_done:
                up = sum(1 for w in workers if w.state != WorkerState.starting)
                state = NodeAttemptState.running if up >= self.local_workers else NodeAttemptState.launching
                if self.parked and self.alive:
                    state = NodeAttemptState.parked
            elif self.stopped:
                state = NodeAttemptState.stopped
            else:
                state = NodeAttemptState.exited
            error = self.error
            if error is None and state == NodeAttemptState.exited and self.exit_code not in (0, None):
                error = self._torchrun_error_tail()
            return AttemptStatusReport(
                fencing_token=self.spec.fencing_token,
                node_rank=self.spec.node_rank,
                state=state,
                exit_code=self.exit_code,
                workers=workers,
                progress=progress,
                result=result,
                error=error,
                error_kind=self.error_kind if error is not None else None,
                ranks=ranks if state == NodeAttemptState.running else None,
            )

    def _torchrun_error_tail(self) -> str | None:
        try:
            with self.paths.torchrun_stderr.open("rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - ERROR_TAIL_BYTES))
                tail = f.read().decode("utf-8", errors="replace").strip()
        except OSError:
            return None
        what = "the command" if self.spec.command else "torchrun"
        return f"{what} exited with {self.exit_code}: ...{tail}" if tail else None

    def mark_final_acked(self) -> None:
        with self._lock:
            if not self.final_acked:
                self.final_acked = True
                self._persist()

    def mark_done(self) -> None:
        with self._lock:
            if not self.done:
                self.done = True
                self._persist()
                self.log.info("attempt_done")


def attempt_paths(work_dir: Path, attempt_id: str) -> AttemptPaths:
    return AttemptPaths(work_dir / "attempts" / attempt_id)
