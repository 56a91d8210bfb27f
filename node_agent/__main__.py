"""python -m node_agent --control-plane URL --name N --address A [--join-token-file F] [options]

The join token comes from --join-token-file or TRAINYARD_JOIN_TOKEN, never the command line."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import structlog

from node_agent.agent import AgentConfig, run_agent
from node_agent.code import CodeLimits
from node_agent.config import read_join_token
from node_agent.gpus import NoGpusError
from node_agent.isolation import IsolationError, UidRange
from node_agent.limits import limit_options
from node_agent.outbox import MAX_BYTES_PER_NODE, MAX_ITEMS_PER_NODE
from trainyard.protocol.memtier import DEFAULT_BUDGET_MB


def _uids(text: str) -> UidRange:
    try:
        return UidRange.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _label(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected k=v, got {text!r}")
    return key, value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m node_agent", description="Trainyard node agent")
    parser.add_argument("--control-plane", required=True, help="control plane URL, e.g. https://10.0.0.1:8000")
    parser.add_argument("--ca-file", type=Path, default=None,
                        help="PEM file of the CA that signed the control plane's certificate (default: system trust)")
    parser.add_argument("--join-token-file", type=Path, default=None,
                        help="file holding a join token (default: TRAINYARD_JOIN_TOKEN)")
    parser.add_argument("--name", required=True, help="node name, unique in the cluster")
    parser.add_argument("--address", required=True, help="address other nodes reach this node at")
    parser.add_argument("--virtual-gpus", type=int, default=None, help="offer N CPU-only slots instead of NVIDIA GPUs")
    parser.add_argument("--work-dir", type=Path, default=Path(".trainyard/agent"))
    parser.add_argument("--label", type=_label, action="append", default=[], help="topology label k=v")
    parser.add_argument("--worker-uids", type=_uids, default=None,
                        help="run each attempt as its own uid from this pool, e.g. 20000-20063 (needs root)")
    parser.add_argument("--worker-root", type=Path, default=None, help="worker directories (default WORK_DIR/workers)")
    parser.add_argument("--run-dir", type=Path, default=None, help="sockets and uid locks (default /run/trainyard)")
    parser.add_argument("--no-cgroups", action="store_true", help="track processes by uid, not by cgroup v2")
    parser.add_argument("--standbys", type=int, default=0,
                        help="warm standby processes (torch imported) that ranks start in instead of cold; "
                        "one per GPU is natural (default 0: off)")
    parser.add_argument("--worker-env", action="append", default=[], help="an agent variable to pass to workers")
    parser.add_argument("--stop-grace", type=float, default=5.0, help="seconds from SIGTERM to SIGKILL")
    parser.add_argument("--handover-timeout", type=float, default=60.0,
                        help="seconds a restartable part's parked workers wait to be taken over by the next attempt")
    parser.add_argument(
        "--keep-workers-on-exit", action="store_true", help="leave workers running when the agent exits"
    )
    parser.add_argument("--pip-constraint", type=Path, default=None,
                        help="constraints for every job's requirements (the node's torch is pinned besides)")
    parser.add_argument("--allowed-python", type=Path, action="append", default=[],
                        help="an interpreter jobs may name as their python besides root-owned ones no one else can "
                        "write (repeatable)")
    parser.add_argument("--env-cache-max-count", type=int, default=8,
                        help="cached venvs of jobs' requirements to keep (least recently used removed first)")
    parser.add_argument("--env-cache-max-gb", type=float, default=20.0, help="disk the cached venvs may take")
    parser.add_argument("--code-max-gb", type=float, default=CodeLimits.max_bytes / 2**30,
                        help="a job's shipped code: its archive, and its unpacked files together, at most this")
    parser.add_argument("--code-max-entries", type=int, default=CodeLimits.max_entries,
                        help="a job's shipped code: files, directories and links in its archive, at most")
    parser.add_argument("--code-timeout", type=float, default=CodeLimits.timeout_s,
                        help="seconds a job's code may take to download, then to unpack, each")
    parser.add_argument("--outbox-max-items", type=int, default=MAX_ITEMS_PER_NODE,
                        help="shards and events held for the control plane, over every attempt of the node")
    parser.add_argument("--outbox-max-mb", type=float, default=MAX_BYTES_PER_NODE / 2**20,
                        help="the same budget in MiB")
    parser.add_argument("--memory-tier-mb", type=int, default=DEFAULT_BUDGET_MB,
                        help="host memory for checkpoint shards (the in-memory tier: this node's ranks' latest "
                        "shards and its peers' copies); 0 turns the tier off")
    parser.add_argument("--memory-port", type=int, default=0,
                        help="TCP port peer agents reach the memory tier on (at --address); 0: any free port")
    parser.add_argument("--memory-tls-cert", type=Path, default=None,
                        help="PEM certificate of this node (for --address, signed by the cluster's CA): the memory "
                        "port speaks TLS and peers are reached over TLS only, verified against --ca-file")
    parser.add_argument("--memory-tls-key", type=Path, default=None, help="PEM private key of --memory-tls-cert")
    parser.add_argument("--memory-plain-http", action="store_true",
                        help="without --memory-tls-cert, serve the memory port in plain HTTP (a trusted network "
                        "only: shards and job grants cross it in clear); without either the tier is off")
    limits = parser.add_argument_group("part limits", "what each attempt part may use (docs/operations.md); "
                                       "default: its share of the node's GPUs of the node's memory, CPUs and disk")
    limits.add_argument("--no-part-limits", action="store_true", help="set no resource limit on parts")
    limits.add_argument("--part-memory-limit", default=None, help="memory per part, e.g. 48G")
    limits.add_argument("--memory-reserve", default=None, help="memory no part's share includes (default 2G)")
    limits.add_argument("--part-pids-max", type=int, default=None, help="processes and threads per part")
    limits.add_argument("--part-cpus", type=float, default=None,
                        help="a hard cap in CPUs of time per part, e.g. 0.5 (default: none; weighted 100 per GPU)")
    limits.add_argument("--part-shm-size", default=None, help="size of each part's /dev/shm, e.g. 8G")
    limits.add_argument("--part-work-dir-size", default=None, help="disk each part's work directory may hold")
    parser.add_argument("--log-level", default="INFO")
    return parser


def parse_args(argv: list[str] | None = None) -> AgentConfig:
    parser = build_parser()
    args = parser.parse_args(argv)
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(args.log_level.upper())),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )
    try:
        return AgentConfig(
            control_plane_url=args.control_plane,
            ca_file=args.ca_file,
            join_token=read_join_token(args.join_token_file),
            name=args.name,
            address=args.address,
            virtual_gpus=args.virtual_gpus,
            work_dir=args.work_dir,
            labels=dict(args.label),
            worker_uids=args.worker_uids,
            worker_root=args.worker_root,
            run_dir=args.run_dir,
            cgroups=not args.no_cgroups,
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
            memory_tier_mb=args.memory_tier_mb,
            memory_port=args.memory_port,
            memory_tls_cert=args.memory_tls_cert,
            memory_tls_key=args.memory_tls_key,
            memory_plain_http=args.memory_plain_http,
            limits=limit_options(enabled=not args.no_part_limits, memory=args.part_memory_limit,
                                 reserve=args.memory_reserve, pids=args.part_pids_max, cpus=args.part_cpus,
                                 shm=args.part_shm_size, work_dir=args.part_work_dir_size),
        )
    except ValueError as exc:
        parser.error(str(exc))


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    try:
        run_agent(config)
    except (NoGpusError, IsolationError) as exc:
        print(f"node_agent: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
