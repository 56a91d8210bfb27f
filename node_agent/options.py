"""The agent's command line, one table of options for both ways of starting it:

    trainyard agent --control-plane URL --name N --address A [--join-token-file F] [options]
    python -m node_agent ...        (the same options: node_agent/__main__.py calls main below)

``trainyard agent`` (trainyard/cli/main.py) hands its arguments to ``main`` unparsed, so an option
exists in both or in neither. The join token comes from --join-token-file or TRAINYARD_JOIN_TOKEN,
never the command line. Bad input ends with one line on stderr and exit status 2, never a
traceback. Options that name a variable (``env=``) take their default from it.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any, NoReturn

import structlog

from node_agent.config import MAX_STANDBYS, AgentConfig, read_join_token
from node_agent.confinement.isolation import IsolationError, UidRange
from node_agent.confinement.limits import limit_options
from node_agent.gpus import NoGpusError
from node_agent.link.batcher import WINDOW_S
from node_agent.link.outbox import MAX_BYTES_PER_NODE, MAX_ITEMS_PER_NODE
from node_agent.part.code import CodeLimits
from trainyard.protocol.memtier import DEFAULT_BUDGET_MB

PROG = "trainyard agent"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # One line, like every other trainyard command (no usage block: --help shows it).
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())}\n")


def _uids(text: str) -> UidRange:
    try:
        return UidRange.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _label(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"--label must look like key=value, got {text!r}")
    return key.strip(), value.strip()


def _bounded(kind: type[int] | type[float], low: float | None = None, high: float | None = None) -> Any:
    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a valid {kind.__name__}") from None
        if (low is not None and value < low) or (high is not None and value > high):
            span = f"{low:g}..{high:g}" if low is not None and high is not None else \
                f">= {low:g}" if low is not None else f"<= {high:g}"
            raise argparse.ArgumentTypeError(f"{text} is not in the range {span}")
        return value

    parse.__name__ = kind.__name__
    return parse


def _standbys(text: str) -> int | None:
    """``auto`` (None: the agent decides, node_agent/agent.py) or a number of standbys."""
    return None if text.strip().lower() == "auto" else _bounded(int, 0, MAX_STANDBYS)(text)


_standbys.__name__ = "standbys"


def _env(name: str, help: str) -> dict[str, Any]:
    """An option whose default is the variable ``name`` (parsed like the option's own value)."""
    return {"default": os.environ.get(name), "help": f"{help} (variable: {name})"}


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    """The one option table of the agent's command line."""
    p = _Parser(prog=prog, allow_abbrev=False,  # --join-token must never be taken for --join-token-file
                description="Run a node agent: register with the control plane and run the attempts it assigns.")
    p.add_argument("--control-plane", required=True, help="control-plane URL, e.g. https://10.0.0.1:8000")
    p.add_argument("--name", required=True, help="node name, unique in the cluster")
    p.add_argument("--address", required=True, help="address other nodes reach this node at")
    p.add_argument("--join-token-file", type=Path, default=None,
                   help="file holding a join token (default: the TRAINYARD_JOIN_TOKEN variable); needed for the "
                   "first registration only: the agent keeps its node credential in its work dir")
    p.add_argument("--ca-file", type=Path, **_env(
        "TRAINYARD_CA_FILE", "PEM file of the CA that signed the control plane's certificate (default: the "
        "system's trust store)"))
    p.add_argument("--virtual-gpus", type=_bounded(int, 0), default=None,
                   help="offer N CPU-only virtual GPU slots instead of discovering NVIDIA GPUs")
    p.add_argument("--work-dir", type=Path, default=None,
                   help="the agent's state directory; keep it across restarts (default: ./.trainyard/agent-NAME)")
    p.add_argument("--label", type=_label, action="append", default=[], help="topology label k=v (repeatable)")
    p.add_argument("--log-level", default="INFO", help="the agent's log level (default INFO)")

    workers = p.add_argument_group("workers", "how attempt parts run (docs/security.md)")
    workers.add_argument("--worker-uids", type=_uids, default=None,
                         help="run each attempt part as its own uid from this pool, e.g. 20000-20063 (needs root); "
                         "without it workers run as the agent's user, not isolated")
    workers.add_argument("--worker-root", type=Path, default=None,
                         help="worker directories (default: WORK_DIR/workers)")
    workers.add_argument("--run-dir", type=Path, default=None,
                         help="sockets and uid locks, shared by the machine's agents (default: /run/trainyard)")
    workers.add_argument("--cgroups", action=argparse.BooleanOptionalAction, default=True,
                         help="track each attempt part in a cgroup v2 where writable (--no-cgroups: by uid)")
    workers.add_argument("--standbys", type=_standbys, **_env(
        "TRAINYARD_AGENT_STANDBYS", "warm standby processes (torch imported, no CUDA) that a new attempt's torchrun "
        "and ranks start in instead of cold; 'auto' (the default): one per GPU and one for torchrun where workers "
        "are tracked by cgroup v2 or --worker-uids, else none; 0: off"))
    workers.add_argument("--worker-env", action="append", default=[],
                         help="a variable of the agent's environment to give workers (repeatable)")
    workers.add_argument("--allowed-python", type=Path, action="append", default=[],
                         help="an interpreter jobs may name as their python besides root-owned ones no one else "
                         "can write (repeatable)")
    workers.add_argument("--stop-grace", type=_bounded(float, 0.001), default=5.0,
                         help="seconds from SIGTERM to SIGKILL (default 5)")
    workers.add_argument("--handover-timeout", type=_bounded(float, 0.001), default=60.0,
                         help="seconds a restartable job's parked workers wait to be taken over by its next "
                         "attempt before they are stopped (and started cold) (default 60)")
    workers.add_argument("--keep-workers-on-exit", action="store_true",
                         help="leave workers running when the agent exits (the next agent adopts them)")

    jobs = p.add_argument_group("job code and requirements")
    jobs.add_argument("--pip-constraint", type=Path, default=None,
                      help="constraints for every job's requirements (the node's torch is pinned besides)")
    jobs.add_argument("--env-cache-max-count", type=_bounded(int, 1), default=8,
                      help="cached venvs of jobs' requirements to keep, least recently used removed first (default 8)")
    jobs.add_argument("--env-cache-max-gb", type=_bounded(float, 0.001), default=20.0,
                      help="disk the cached venvs may take (default 20)")
    jobs.add_argument("--code-max-gb", type=_bounded(float, 1e-9), default=CodeLimits.max_bytes / 2**30,
                      help="a job's shipped code: its archive, and its unpacked files together, at most this "
                      f"(default {CodeLimits.max_bytes / 2**30:g})")
    jobs.add_argument("--code-max-entries", type=_bounded(int, 1), default=CodeLimits.max_entries,
                      help=f"a job's shipped code: files, directories and links in its archive, at most "
                      f"(default {CodeLimits.max_entries})")
    jobs.add_argument("--code-timeout", type=_bounded(float, 0.001), default=CodeLimits.timeout_s,
                      help=f"seconds a job's code may take to download, then to unpack, each "
                      f"(default {CodeLimits.timeout_s:g})")

    relay = p.add_argument_group("reports held for the control plane")
    relay.add_argument("--outbox-max-items", type=_bounded(int, 2), default=MAX_ITEMS_PER_NODE,
                       help=f"shards and events held for the control plane, over every attempt of the node "
                       f"(default {MAX_ITEMS_PER_NODE})")
    relay.add_argument("--outbox-max-mb", type=_bounded(float, 0.001), default=MAX_BYTES_PER_NODE / 2**20,
                       help=f"the same budget in MiB (default {MAX_BYTES_PER_NODE / 2**20:g})")
    relay.add_argument("--batch-window-ms", type=_bounded(float, 0, 1000), default=WINDOW_S * 1000,
                       help="milliseconds the workers' upload-slot and storage requests are gathered into one request "
                       f"to the control plane (default {WINDOW_S * 1000:g}; 0: only those that arrive together)")

    memory = p.add_argument_group("memory tier", "checkpoint shards kept in host memory (docs/operations.md)")
    memory.add_argument("--memory-tier-mb", type=_bounded(int, 0), **_env(
        "TRAINYARD_AGENT_MEMORY_TIER_MB", "host memory for checkpoint shards (this node's ranks' latest shards and "
        f"its peers' copies); 0 turns the tier off (default {DEFAULT_BUDGET_MB})"))
    memory.add_argument("--memory-port", type=_bounded(int, 0, 65535), default=0,
                        help="TCP port peer agents reach the memory tier on, at --address (default 0: any free port)")
    memory.add_argument("--memory-tls-cert", type=Path, **_env(
        "TRAINYARD_AGENT_MEMORY_TLS_CERT", "PEM certificate of this node (for --address, signed by the cluster's "
        "CA): the memory port speaks TLS, and peers are reached over TLS only, verified against --ca-file; needs "
        "--memory-tls-key"))
    memory.add_argument("--memory-tls-key", type=Path, **_env(
        "TRAINYARD_AGENT_MEMORY_TLS_KEY", "PEM private key of --memory-tls-cert"))
    memory.add_argument("--memory-plain-http", action="store_true",
                        help="without --memory-tls-cert, serve the memory port in plain HTTP (a trusted network "
                        "only: shards and job grants cross it in clear); without either the tier is off")

    limits = p.add_argument_group("part limits", "what each attempt part may use (docs/operations.md); default: "
                                  "its share of the node's GPUs of the node's memory, CPUs and disk")
    limits.add_argument("--part-limits", action=argparse.BooleanOptionalAction, default=True,
                        help="resource limits on each attempt part: memory, pids, CPU, /dev/shm, work dir "
                        "(--no-part-limits: none)")
    limits.add_argument("--part-memory-limit", **_env(
        "TRAINYARD_AGENT_PART_MEMORY_LIMIT", "memory per part, e.g. 48G (default: the part's share of the node's "
        "GPUs of the node's memory less --memory-reserve)"))
    limits.add_argument("--memory-reserve", **_env(
        "TRAINYARD_AGENT_MEMORY_RESERVE", "memory no part's share includes: the agent, the system (default 2G)"))
    limits.add_argument("--part-pids-max", type=_bounded(int, 1), **_env(
        "TRAINYARD_AGENT_PART_PIDS_MAX", "processes and threads per part (default: 4096 per GPU)"))
    limits.add_argument("--part-cpus", type=_bounded(float, 0.01), default=None,
                        help="a hard cap in CPUs of time per part, e.g. 0.5 (default: none; a CPU weight of 100 "
                        "per GPU)")
    limits.add_argument("--part-shm-size", **_env(
        "TRAINYARD_AGENT_PART_SHM_SIZE", "size of each part's /dev/shm, e.g. 8G (default: half its memory limit)"))
    limits.add_argument("--part-work-dir-size", default=None,
                        help="disk each part's work directory may hold (default: its GPU share of the file system)")
    return p


def _memory_tier_mb(value: int | None) -> int:
    return DEFAULT_BUDGET_MB if value is None else value


def config_from(args: argparse.Namespace) -> AgentConfig:
    """The AgentConfig the parsed options describe; raises ValueError with what is wrong."""
    return AgentConfig(
        control_plane_url=args.control_plane,
        ca_file=args.ca_file,
        join_token=read_join_token(args.join_token_file),
        name=args.name,
        address=args.address,
        virtual_gpus=args.virtual_gpus,
        work_dir=args.work_dir if args.work_dir is not None else Path(".trainyard") / f"agent-{args.name}",
        labels=dict(args.label),
        worker_uids=args.worker_uids,
        worker_root=args.worker_root,
        run_dir=args.run_dir,
        cgroups=args.cgroups,
        standbys=args.standbys,
        worker_env_passthrough=tuple(args.worker_env),
        stop_grace_s=args.stop_grace,
        handover_timeout_s=args.handover_timeout,
        keep_workers_on_exit=args.keep_workers_on_exit,
        pip_constraints=args.pip_constraint,
        allowed_pythons=tuple(args.allowed_python),
        env_cache_max_count=args.env_cache_max_count,
        env_cache_max_gb=args.env_cache_max_gb,
        code_max_bytes=int(args.code_max_gb * 2**30),
        code_max_entries=args.code_max_entries,
        code_timeout_s=args.code_timeout,
        outbox_max_items=args.outbox_max_items,
        outbox_max_bytes=int(args.outbox_max_mb * 2**20),
        batch_window_s=args.batch_window_ms / 1000,
        memory_tier_mb=_memory_tier_mb(args.memory_tier_mb),
        memory_port=args.memory_port,
        memory_tls_cert=args.memory_tls_cert,
        memory_tls_key=args.memory_tls_key,
        memory_plain_http=args.memory_plain_http,
        limits=limit_options(enabled=args.part_limits, memory=args.part_memory_limit, reserve=args.memory_reserve,
                             pids=args.part_pids_max, cpus=args.part_cpus, shm=args.part_shm_size,
                             work_dir=args.part_work_dir_size),
    )


def parse_args(argv: list[str] | None = None, prog: str = PROG) -> AgentConfig:
    """The AgentConfig of a command line (exits 2 with one line on bad input); sets the log level."""
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    level = logging.getLevelName(args.log_level.upper())
    if not isinstance(level, int):
        parser.error(f"--log-level: unknown level {args.log_level!r}")
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )
    try:
        return config_from(args)
    except ValueError as exc:
        parser.error(str(exc))


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    """Run an agent from a command line until it is stopped; the exit status."""
    from node_agent.agent import run_agent  # deferred: the agent's loops and servers, not needed for --help

    config = parse_args(argv, prog)
    try:
        run_agent(config)
    except (NoGpusError, IsolationError) as exc:
        print(f"{prog}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    return 0
