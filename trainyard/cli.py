"""The ``trainyard`` command line: server, migrate, agent, dev up.

Heavy modules (uvicorn, the control plane, the agent, the embedded servers) are imported inside the
commands, so ``trainyard --help`` stays fast. Bad input ends with one line on stderr and a non-zero
exit status, never a traceback.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(
    name="trainyard",
    help="Self-hosted multi-node GPU training: control plane, node agents, and a local dev cluster.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
dev_app = typer.Typer(help="A complete cluster on this machine, for trying Trainyard out.", no_args_is_help=True)
app.add_typer(dev_app, name="dev")


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
) -> None:
    """Run the control plane (settings from TRAINYARD_* environment variables)."""
    import uvicorn

    from control_plane.settings import Settings

    try:
        Settings()  # validate the environment before uvicorn starts: one clear line if it is wrong
    except ValueError as exc:
        raise CliError(f"invalid settings: {_first_line(exc)}") from exc
    uvicorn.run(
        "control_plane.app:create_app",
        factory=True,
        host=host,
        port=port,
        log_level=log_level,
        # The control plane's own logging covers requests; uvicorn's access log would double them.
        access_log=False,
    )


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


@app.command()
def agent(
    control_plane: Annotated[str, typer.Option(help="Control-plane URL, e.g. http://10.0.0.1:8000.")],
    join_token: Annotated[str, typer.Option(help="The cluster's join token.", envvar="TRAINYARD_JOIN_TOKEN")],
    name: Annotated[str, typer.Option(help="Node name, unique in the cluster.")],
    address: Annotated[str, typer.Option(help="Address other nodes reach this node at.")],
    virtual_gpus: Annotated[
        int | None,
        typer.Option(min=0, help="Offer this many CPU-only virtual GPU slots instead of discovering NVIDIA GPUs."),
    ] = None,
    work_dir: Annotated[
        Path | None,
        typer.Option(help="Agent state directory. Default: ./.trainyard/agent-NAME.", show_default=False),
    ] = None,
    label: Annotated[list[str] | None, typer.Option(help="Topology label k=v (repeatable).")] = None,
    replace: Annotated[
        bool,
        typer.Option(help="Take the node name over even while another agent instance holds it (that one "
                     "stops). Without it this agent waits until that node is lost or removed."),
    ] = False,
) -> None:
    """Run a node agent: register with the control plane and run the attempts it assigns."""
    labels = _parse_labels(label or [])
    from node_agent.agent import AgentConfig, run_agent

    try:
        config = AgentConfig(
            control_plane_url=control_plane,
            join_token=join_token,
            name=name,
            address=address,
            virtual_gpus=virtual_gpus,
            work_dir=work_dir if work_dir is not None else Path(".trainyard") / f"agent-{name}",
            labels=labels,
            local_api_port=0,
            stop_grace_s=5.0,
            replace=replace,
        )
    except ValueError as exc:
        raise CliError(str(exc)) from exc
    run_agent(config)


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
    token: Annotated[
        str | None, typer.Option(help="Admin token. Default: a new random one.", show_default=False)
    ] = None,
    database_url: Annotated[
        str | None, typer.Option(help="Use this PostgreSQL instead of starting one.", show_default=False)
    ] = None,
    s3_endpoint: Annotated[
        str | None,
        typer.Option(help="host:port of an S3 server to use instead of starting one.", show_default=False),
    ] = None,
    s3_access_key: Annotated[str | None, typer.Option(help="With --s3-endpoint.", show_default=False)] = None,
    s3_secret_key: Annotated[str | None, typer.Option(help="With --s3-endpoint.", show_default=False)] = None,
    s3_bucket: Annotated[str, typer.Option(help="Checkpoint bucket.")] = "trainyard",
) -> None:
    """Start Postgres, S3, the control plane and NODES agents in the foreground; Ctrl-C stops all."""
    from trainyard.dev import DevConfig, DevError, run_dev_up

    try:
        config = DevConfig(
            nodes=nodes,
            gpus_per_node=gpus_per_node,
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
        )
    except ValueError as exc:
        raise CliError(str(exc)) from exc
    try:
        code = run_dev_up(config)
    except DevError as exc:
        raise CliError(str(exc), code=1) from exc
    raise typer.Exit(code)


def _parse_labels(items: list[str]) -> dict[str, str]:
    labels: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise CliError(f"--label must look like key=value, got {item!r}")
        labels[key.strip()] = value.strip()
    return labels


def _first_line(exc: BaseException) -> str:
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
    except CliError as exc:
        print(f"trainyard: error: {' '.join(str(exc).split())}", file=sys.stderr)
        sys.exit(exc.code)
    except KeyboardInterrupt:
        sys.exit(130)
    sys.exit(result if isinstance(result, int) else 0)
