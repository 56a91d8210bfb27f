"""The ``trainyard`` command line: server, migrate, agent, dev up.

Heavy modules (uvicorn, the control plane, the agent, the embedded servers) are imported inside the
commands, so ``trainyard --help`` stays fast. Bad input ends with one line on stderr and a non-zero
exit status, never a traceback.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from trainyard.cli import access as cli_access
from trainyard.cli import jobs as cli_jobs
from trainyard.cli.api_client import ApiError

app = typer.Typer(
    name="trainyard",
    help="Self-hosted multi-node GPU training: jobs, nodes, a local dev cluster, the layout planner, the "
    "control plane and node agents.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
dev_app = typer.Typer(help="A complete cluster on this machine, for trying Trainyard out.", no_args_is_help=True)
app.add_typer(dev_app, name="dev")
dev_node_app = typer.Typer(help="Act on a node of the running `trainyard dev up` (to try fault tolerance by hand).",
                           no_args_is_help=True)
dev_app.add_typer(dev_node_app, name="node")
app.add_typer(cli_access.principals_app, name="principals")
app.add_typer(cli_access.tokens_app, name="tokens")
app.add_typer(cli_access.join_app, name="join-tokens")
app.command("whoami")(cli_access.whoami)
for _command in (cli_jobs.login, cli_jobs.run, cli_jobs.ps, cli_jobs.describe, cli_jobs.logs, cli_jobs.cancel):
    app.command(rich_help_panel="Jobs")(_command)
app.add_typer(cli_jobs.nodes_app, name="nodes", rich_help_panel="Cluster")
app.add_typer(cli_jobs.tenants_app, name="tenants", rich_help_panel="Cluster")


class CliError(Exception):
    """Bad input or a failed precondition: reported as one line, exit status 2 (1 for ``code=1``)."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


@app.command()
def server(
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="Port to listen on.")] = 8000,
    log_level: Annotated[str, typer.Option(help="uvicorn's log level.")] = "info",
    tls_cert: Annotated[
        Path | None,
        typer.Option(help="PEM certificate (chain) to serve HTTPS with; needs --tls-key.",
                     envvar="TRAINYARD_TLS_CERT", show_default=False),
    ] = None,
    tls_key: Annotated[
        Path | None,
        typer.Option(help="PEM private key of --tls-cert.", envvar="TRAINYARD_TLS_KEY", show_default=False),
    ] = None,
) -> None:
    """Run the control plane (settings from TRAINYARD_* environment variables); HTTPS with
    --tls-cert and --tls-key, plain HTTP without (then only behind a TLS-terminating proxy)."""
    import uvicorn

    from control_plane.http_deadlines import DrainingServer, uvicorn_options
    from control_plane.settings import Settings

    try:
        settings = Settings()  # validate the environment before uvicorn starts: one clear line if it is wrong
    except ValueError as exc:
        raise CliError(f"invalid settings: {_first_line(exc)}") from exc
    certfile, keyfile = _check_tls(tls_cert, tls_key)
    config = uvicorn.Config(
        "control_plane.app:create_app",
        factory=True,
        host=host,
        port=port,
        log_level=log_level,
        # The control plane's own logging covers requests; uvicorn's access log would double them.
        access_log=False,
        ssl_certfile=certfile,
        ssl_keyfile=keyfile,
        **uvicorn_options(settings),
    )
    DrainingServer(config).run()


def _check_tls(cert: Path | None, key: Path | None) -> tuple[str | None, str | None]:
    """uvicorn's TLS options, after checking the pair loads (one line if it does not)."""
    if cert is None and key is None:
        return None, None
    if cert is None or key is None:
        raise CliError("--tls-cert and --tls-key go together")
    import ssl

    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise CliError(f"cannot use the TLS certificate {cert} with key {key}: {_first_line(exc)}") from exc
    return str(cert), str(key)


@app.command()
def migrate(
    database_url: Annotated[
        str | None,
        typer.Option(help="SQLAlchemy URL; default: TRAINYARD_DATABASE_URL.", show_default=False),
    ] = None,
) -> None:
    """Bring the database schema up to date (Alembic upgrade head)."""
    from sqlalchemy.exc import ArgumentError, SQLAlchemyError

    from control_plane.db import run_migrations

    if database_url is None:
        from control_plane.settings import Settings

        try:
            database_url = Settings().database_url
        except ValueError as exc:
            raise CliError(f"invalid settings: {_first_line(exc)}") from exc
    try:
        run_migrations(database_url)
    except ArgumentError as exc:
        raise CliError(f"bad database URL: {_first_line(exc)}") from exc
    except SQLAlchemyError as exc:
        raise CliError(f"migration failed: {_first_line(exc)}", code=1) from exc
    typer.echo("database schema is up to date")


@app.command(add_help_option=False, context_settings={"allow_extra_args": True, "ignore_unknown_options": True,
                                                     "allow_interspersed_args": False})
def agent(ctx: typer.Context) -> int:
    """Run a node agent: register with the control plane and run the attempts it assigns."""
    # The agent's own option table parses every argument (node_agent/options.py): `python -m
    # node_agent` is the same command, so an option cannot exist in one and not the other.
    from node_agent.options import main as agent_main

    return agent_main(list(ctx.args), prog="trainyard agent")


@app.command()
def plan(
    seq_len: Annotated[int, typer.Option(help="Tokens per sample.")],
    global_batch: Annotated[int, typer.Option(help="Samples per optimizer step.")],
    gpu_kind: Annotated[str, typer.Option(help="h100, h200, a100-sxm, l40s, ... or a kind the nodes report.")],
    params: Annotated[float | None, typer.Option(help="Parameters, e.g. 7.5e9 (or give the shape).")] = None,
    layers: Annotated[int | None, typer.Option(help="Transformer layers.")] = None,
    hidden: Annotated[int | None, typer.Option(help="Hidden size.")] = None,
    vocab: Annotated[int | None, typer.Option(help="Vocabulary size.")] = None,
    heads: Annotated[int | None, typer.Option(help="Attention heads (default hidden/128).")] = None,
    micro_batch: Annotated[int | None, typer.Option(help="Samples per GPU per micro-step (accumulation).")] = None,
    precision: Annotated[str, typer.Option(help="bf16-mixed, fp16-mixed, fp32 or bf16.")] = "bf16-mixed",
    optimizer: Annotated[str, typer.Option(help="adamw, adam, sgd-momentum or sgd.")] = "adamw",
    activation_checkpointing: Annotated[bool, typer.Option(help="Recompute activations in backward.")] = False,
    activation_bytes: Annotated[
        float | None, typer.Option(help="Measured activation bytes per sample (default: from the shape).")] = None,
    mfu: Annotated[float, typer.Option(help="Model FLOPs utilisation of the compute.")] = 0.4,
    gpus_per_node: Annotated[int, typer.Option(help="GPUs per node.")] = 8,
    gpus: Annotated[str | None, typer.Option(help="GPU counts, e.g. 8,16,32 (default 1-64 nodes).")] = None,
    layout: Annotated[list[str] | None, typer.Option(
        help="ddp, fsdp, hsdp[:SHARD], tp_dp[:TP], ddp+bf16 (repeatable; default all).")] = None,
    intra_link: Annotated[str | None, typer.Option(help="nvlink3/4/5, pcie4/5: override the kind's.")] = None,
    inter_link: Annotated[str | None, typer.Option(help="infiniband, roce or ethernet: override the kind's.")] = None,
    inter_gbits: Annotated[float | None, typer.Option(help="A node's NICs together, Gbit/s.")] = None,
    min_efficiency: Annotated[float | None, typer.Option(help="Least scaling efficiency recommended.")] = None,
    control_plane: Annotated[str, typer.Option(help="Control-plane URL.", envvar="TRAINYARD_URL")] = (
        "https://127.0.0.1:8000"),
    token_file: cli_access.TokenFile = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the API's JSON instead of the table.")] = False,
) -> None:
    """Plan a model's parallel layout: memory per GPU, bytes per link, step time and tokens/s of
    DDP, FSDP, HSDP and TP x DP on each GPU count, and a recommendation (POST /v1/plans)."""
    import json

    from rich.console import Console

    from trainyard.cli.plan_view import parse_counts, parse_layout, render

    try:
        counts = parse_counts(gpus) if gpus else None
        layouts = [parse_layout(item) for item in layout] if layout else None
    except ValueError as exc:
        raise CliError(str(exc)) from exc
    model = {"params": params, "layers": layers, "hidden": hidden, "vocab": vocab, "heads": heads, "seq_len": seq_len,
             "global_batch": global_batch, "micro_batch": micro_batch, "precision": precision,
             "optimizer": optimizer, "activation_checkpointing": activation_checkpointing,
             "activation_bytes_per_sample": activation_bytes, "mfu": mfu}
    hardware = {"intra_link": intra_link, "inter_link": inter_link, "inter_gbits_per_s": inter_gbits}
    body = {
        "model": {k: v for k, v in model.items() if v is not None},
        "gpu_kind": gpu_kind, "gpus_per_node": gpus_per_node, "gpu_counts": counts, "layouts": layouts,
        "hardware": {k: v for k, v in hardware.items() if v is not None} or None, "min_efficiency": min_efficiency,
    }
    # The token from TRAINYARD_TOKEN or a file, never an argument (other users see command lines).
    token = cli_access.read_secret(token_file, "TRAINYARD_TOKEN") if token_file or os.environ.get(
        "TRAINYARD_TOKEN") else ""
    result = _api_post(control_plane, token, "/v1/plans", {k: v for k, v in body.items() if v is not None})
    if as_json:
        typer.echo(json.dumps(result, indent=2))
    else:
        render(result, Console(width=160))


@app.command()
def simulate(
    nodes: Annotated[int, typer.Option(help="Nodes the job runs on.")],
    blocking_s: Annotated[float, typer.Option(help="Seconds one save blocks training.")],
    node_mtbf_h: Annotated[float | None, typer.Option(help="Hours between failures of one node.")] = None,
    interruptions: Annotated[int | None, typer.Option(help="Or: failures seen over --days (e.g. 419).")] = None,
    days: Annotated[float | None, typer.Option(help="With --interruptions.")] = None,
    work_h: Annotated[float, typer.Option(help="Hours of training the job needs.")] = 720,
    background_s: Annotated[float, typer.Option(help="Upload after the blocking part (async; 0: sync).")] = 0,
    sync_blocking_s: Annotated[float | None, typer.Option(help="The same save done synchronously.")] = None,
    interval_s: Annotated[float | None, typer.Option(help="Compute between saves (default: the best).")] = None,
    recovery_s: Annotated[float, typer.Option(help="Failure to training again, a node at hand.")] = 600,
    spares: Annotated[int | None, typer.Option(help="Spare nodes (default: always one at hand).")] = None,
    repair_h: Annotated[float, typer.Option(help="Hours until a failed node is back.")] = 24,
    runs: Annotated[int, typer.Option(help="Runs averaged.")] = 5,
    seed: Annotated[int, typer.Option(help="Seed of the first run.")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON (POST /v1/simulations's answer).")] = False,
) -> None:
    """Simulate one long job's goodput: failures, saves, recoveries and spares (docs/goodput.md).
    Runs here (the model is pure); POST /v1/simulations answers the same."""
    import json

    from pydantic import ValidationError
    from rich.console import Console

    from control_plane.errors import Unprocessable
    from control_plane.schemas.simulations import SimulationIn
    from control_plane.services.read.simulations import simulate as run_simulation
    from trainyard.cli.simulate_view import render

    fields = {"nodes": nodes, "node_mtbf_h": node_mtbf_h, "interruptions": interruptions, "days": days,
              "work_h": work_h, "interval_s": interval_s, "blocking_s": blocking_s, "background_s": background_s,
              "sync_blocking_s": sync_blocking_s, "recovery_s": recovery_s, "spares": spares, "repair_h": repair_h,
              "runs": runs, "seed": seed}
    try:
        result = run_simulation(SimulationIn(**{k: v for k, v in fields.items() if v is not None}))
    except ValidationError as exc:
        errors = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'input'}: {e['msg']}" for e in exc.errors())
        raise CliError(errors) from exc
    except Unprocessable as exc:
        raise CliError(str(exc)) from exc
    if as_json:
        typer.echo(json.dumps(result.model_dump(mode="json"), indent=2))
    else:
        render(result, Console(width=120))


def _api_post(url: str, token: str, path: str, body: dict[str, Any]) -> Any:
    """POST to the control plane; any failure is one line (the problem+json detail when there is one)."""
    import httpx

    from trainyard.cli.tls import cli_context, untrusted

    try:
        response = httpx.post(url.rstrip("/") + path, json=body, timeout=30.0, verify=cli_context(),
                              headers={"Authorization": f"Bearer {token}"} if token else {})
    except httpx.HTTPError as exc:
        why = untrusted(exc) or _first_line(exc) or type(exc).__name__
        raise CliError(f"cannot reach the control plane at {url}: {why}", code=1) from exc
    if response.status_code >= 400:
        try:
            problem = response.json()
            detail = problem.get("detail") or problem.get("title") or response.reason_phrase
        except ValueError:
            detail = response.text[:200] or response.reason_phrase
        raise CliError(f"{response.status_code}: {detail}", code=1)
    try:
        return response.json()
    except ValueError as exc:
        raise CliError(f"the control plane at {url} did not answer JSON", code=1) from exc


@dev_app.command("up")
def dev_up(
    nodes: Annotated[int, typer.Option(min=1, max=200, help="Number of node agents.")] = 2,
    gpus_per_node: Annotated[int, typer.Option(min=1, help="Virtual GPU slots per node.")] = 2,
    port: Annotated[int, typer.Option(min=1, max=65535, help="Control-plane port.")] = 8000,
    replicas: Annotated[
        int, typer.Option(min=1, max=16, help="Control-plane replicas on one database (ports PORT, PORT+1, ...).")
    ] = 1,
    host: Annotated[str, typer.Option(help="Control-plane address.")] = "127.0.0.1",
    data_dir: Annotated[Path, typer.Option(help="Where databases, objects, logs and node dirs live.")] = Path(
        ".trainyard/dev"
    ),
    token_file: Annotated[Path | None, typer.Option(
        "--token-file", envvar="TRAINYARD_TOKEN_FILE", show_default=False,
        help="File holding the admin token to use (default: the TRAINYARD_TOKEN variable, else a new random one).",
    )] = None,
    database_url: Annotated[
        str | None, typer.Option(help="Use this PostgreSQL instead of starting one.", show_default=False)
    ] = None,
    s3_endpoint: Annotated[
        str | None,
        typer.Option(help="host:port (or https://host:port) of an S3 server to use instead of starting one.",
                     show_default=False),
    ] = None,
    s3_access_key: Annotated[str | None, typer.Option(
        help="With --s3-endpoint: the access key id (an identifier, not a secret).", show_default=False)] = None,
    s3_secret_key_file: Annotated[Path | None, typer.Option(
        help="With --s3-endpoint: file holding the secret key (default: the TRAINYARD_S3_SECRET_KEY variable).",
        show_default=False)] = None,
    s3_bucket: Annotated[str, typer.Option(help="Checkpoint bucket.")] = "trainyard",
    s3_ca_file: Annotated[Path | None, typer.Option(
        help="With an https:// --s3-endpoint: PEM file of the CA that signed its certificate (default: the "
        "system's trust store). The control plane and, through the agents, the workers verify S3 with it.",
        show_default=False)] = None,
    insecure_http: Annotated[
        bool, typer.Option("--insecure-http", help="Serve the API over plain HTTP instead of HTTPS with a local CA.")
    ] = False,
    standbys: Annotated[int | None, typer.Option(
        min=0, max=64, help="Warm standby processes per agent (torch imported) that a new attempt's torchrun and "
        "ranks start in instead of cold (default: the agent's, one per GPU and one for torchrun).",
        show_default=False)] = None,
    netns: Annotated[bool, typer.Option(
        "--netns", help="Root only: each node in a network namespace of its own, on bridges joined by links "
        "with real limits (docs/operations.md, 'A rack layout on one machine').")] = False,
    racks: Annotated[int, typer.Option(min=1, help="With --netns: racks, the nodes in contiguous blocks.")] = 1,
    node_link: Annotated[str | None, typer.Option(
        help="With --netns: each node's link rate, both ways (e.g. 10gbit).", show_default=False)] = None,
    rack_uplink: Annotated[str | None, typer.Option(
        help="With --netns: each rack's uplink rate, shared by its nodes (e.g. 1gbit).", show_default=False)] = None,
    rack_delay_ms: Annotated[float, typer.Option(
        min=0, help="With --netns: delay on each rack uplink (needs the kernel's netem).")] = 0.0,
) -> None:
    """Start Postgres, S3, the control plane and NODES agents in the foreground; Ctrl-C stops all."""
    from trainyard.dev import DevConfig, DevError, run_dev_up
    from trainyard.dev.netns import Shape, Topology, parse_rate

    # Secrets from files or the environment, never arguments: other users see command lines.
    token = cli_access.read_secret(token_file, "TRAINYARD_TOKEN") if token_file else (
        os.environ.get("TRAINYARD_TOKEN", "").strip() or None)
    s3_secret_key = None
    if s3_secret_key_file is not None or (s3_endpoint and os.environ.get("TRAINYARD_S3_SECRET_KEY")):
        s3_secret_key = cli_access.read_secret(s3_secret_key_file, "TRAINYARD_S3_SECRET_KEY")
    network = None
    if netns:
        try:
            network = Topology(racks=racks,
                               node_link=Shape(parse_rate(node_link) if node_link else None),
                               rack_uplink=Shape(parse_rate(rack_uplink) if rack_uplink else None, rack_delay_ms))
        except ValueError as exc:
            raise CliError(str(exc)) from exc
    elif racks != 1 or node_link or rack_uplink or rack_delay_ms:
        raise CliError("--racks, --node-link, --rack-uplink and --rack-delay-ms go with --netns")
    try:
        config = DevConfig(
            network=network,
            nodes=nodes,
            gpus_per_node=gpus_per_node,
            standbys=standbys,
            port=port,
            replicas=replicas,
            host=host,
            data_dir=data_dir,
            token=token,
            database_url=database_url,
            s3_endpoint=s3_endpoint,
            s3_access_key=s3_access_key,
            s3_secret_key=s3_secret_key,
            s3_bucket=s3_bucket,
            s3_ca_file=s3_ca_file,
            tls=not insecure_http,
        )
    except ValueError as exc:
        raise CliError(str(exc)) from exc
    try:
        code = run_dev_up(config)
    except DevError as exc:
        raise CliError(str(exc), code=1) from exc
    raise typer.Exit(code)


DevDataDir = Annotated[Path, typer.Option(help="The data dir of the running `trainyard dev up`.")]


def _dev_node(action: str, node: str, data_dir: Path) -> None:
    from trainyard.dev.control import ControlError, ask

    try:
        typer.echo(ask(data_dir.expanduser().resolve(), action, node), err=True)
    except ControlError as exc:
        raise CliError(str(exc), code=1) from exc


@dev_node_app.command("kill")
def dev_node_kill(node: str, data_dir: DevDataDir = Path(".trainyard/dev")) -> None:
    """SIGKILL a node's agent and every process under it: the node dies (the control plane declares it
    lost and recovers its jobs on the others)."""
    _dev_node("kill", node, data_dir)


@dev_node_app.command("kill-workers")
def dev_node_kill_workers(node: str, data_dir: DevDataDir = Path(".trainyard/dev")) -> None:
    """SIGKILL a node's workers only: crashed training processes (the job recovers from its checkpoint)."""
    _dev_node("kill-workers", node, data_dir)


@dev_node_app.command("restart")
def dev_node_restart(node: str, data_dir: DevDataDir = Path(".trainyard/dev")) -> None:
    """Start a killed node's agent again, on its work dir."""
    _dev_node("restart", node, data_dir)


def _first_line(exc: BaseException) -> str:
    errors = getattr(exc, "errors", None)
    if callable(errors) and type(exc).__name__ == "ValidationError":  # pydantic's: say what is wrong, not its title
        with contextlib.suppress(Exception):
            return "; ".join(
                (f"{'.'.join(str(p) for p in e['loc'])}: " if e.get("loc") else "")
                + str(e["msg"]).removeprefix("Value error, ") for e in errors())
    text = str(exc).strip()
    return " ".join(text.split()) if len(text) < 300 else text.splitlines()[0]


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point (``trainyard``; also ``python -m trainyard``)."""
    command = typer.main.get_command(app)
    try:
        # standalone_mode=False: usage errors come to us (one line) instead of a rich error box.
        result = command.main(args=argv, prog_name="trainyard", standalone_mode=False)
    except typer.Abort:
        print("trainyard: aborted", file=sys.stderr)
        sys.exit(130)
    except typer.TyperException as exc:  # usage errors (typer vendors click: its exceptions derive from this)
        message = " ".join(exc.format_message().split())
        if message:  # empty after "no arguments: here is the help"
            print(f"trainyard: error: {message}", file=sys.stderr)
        sys.exit(exc.exit_code)
    except (CliError, cli_access.AccessError, ApiError) as exc:
        print(f"trainyard: error: {' '.join(str(exc).split())}", file=sys.stderr)
        sys.exit(exc.code if isinstance(exc, CliError) else 1)
    except KeyboardInterrupt:
        sys.exit(130)
    sys.exit(result if isinstance(result, int) else 0)
