"""``trainyard login|run|ps|describe|logs|cancel|nodes|tenants``: using a cluster without curl.

Jobs are named by id, by name (the newest job of that name) or by the first 8+ characters of the
id (what ``ps`` shows). Failures are one line, from the API's problem+json ``detail``.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import uuid
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from trainyard.cli import job_view
from trainyard.cli.api_client import Api, ApiError, Format, OutputFormat, TokenFile, Url, read_token_file, save_config

nodes_app = typer.Typer(help="Nodes: list them, cordon, drain, uncordon (operators).", invoke_without_command=True)
tenants_app = typer.Typer(help="Tenants: their weights, quotas and GPUs in use (operators).",
                          invoke_without_command=True)

ACTIVE = ("queued", "starting", "running", "recovering", "cancelling")


def _console() -> Console:
    return Console(width=None if sys.stdout.isatty() else 200, highlight=False)


def complete_job(incomplete: str) -> list[str]:
    """Shell completion of a JOB argument: recent job names (nothing when the API cannot be reached)."""
    try:
        api = Api.from_options(None, None)
        api.timeout_s = 3.0
        return sorted({j["name"] for j in api.get("/v1/jobs", limit=100)["items"] if j["name"].startswith(incomplete)})
    except Exception:
        return []


JobRef = Annotated[str, typer.Argument(help="Job id, name, or the first 8+ characters of its id.",
                                       autocompletion=complete_job)]


def login(
    url: Annotated[str, typer.Argument(help="Control-plane URL, e.g. https://trainyard.example:8000.")],
    token_file: Annotated[Path | None, typer.Option(
        "--token-file", help="Read the token from this file (default: TRAINYARD_TOKEN, else a prompt).")] = None,
    ca_file: Annotated[Path | None, typer.Option(
        "--ca-file", envvar="TRAINYARD_CA_FILE", show_default=False,
        help="The CA that signed the control plane's certificate (dev up: DATA_DIR/tls/ca.pem); default: "
        "the system's trust store.")] = None,
) -> None:
    """Check a token against a control plane and remember both (a 0600 config file)."""
    config = {"ca_file": str(ca_file.resolve())} if ca_file is not None else {}
    if ca_file is not None and not ca_file.is_file():
        raise ApiError(f"--ca-file {ca_file} is not a file")
    if token_file is not None:
        token = read_token_file(token_file)
    elif os.environ.get("TRAINYARD_TOKEN", "").strip():
        token = os.environ["TRAINYARD_TOKEN"].strip()
    else:
        token = typer.prompt("API token", hide_input=True).strip()
        if not token:
            raise ApiError("no token given")
    api = Api(url.rstrip("/"), token, ca_file=config.get("ca_file"))
    me = api.get("/v1/whoami")
    path = save_config({"url": api.url, "token": token, **config})
    print(f"logged in to {api.url} as {me['name']} ({me['role']} of tenant {me['tenant']}); saved in {path}",
          file=sys.stderr)


def load_spec(path: Path) -> tuple[dict[str, Any], Path | None]:
    """A job file: the submit body as YAML (or JSON), plus ``workdir`` and ``requirements_file``
    (relative to the file; the latter's text becomes the body's ``requirements``)."""
    import yaml

    try:
        spec = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ApiError(f"cannot read {path}: {exc.strerror or exc}") from exc
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        at = f" at line {where.line + 1} column {where.column + 1}" if where is not None else ""
        raise ApiError(f"{path} is not valid YAML{at}: {getattr(exc, 'problem', None) or exc}") from exc
    if not isinstance(spec, dict):
        raise ApiError(f"{path} must hold a mapping of job fields (name, num_nodes, entrypoint, ...)")
    workdir = spec.pop("workdir", None)
    if workdir is not None and not isinstance(workdir, str):
        raise ApiError(f"{path}: workdir must be a path")
    requirements = spec.pop("requirements_file", None)
    if requirements is not None:
        if not isinstance(requirements, str) or "requirements" in spec:
            raise ApiError(f"{path}: requirements_file must be a path (and the file may not also set requirements)")
        try:
            spec["requirements"] = (path.parent / requirements).read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise ApiError(f"{path}: cannot read requirements_file {requirements}: "
                           f"{getattr(exc, 'strerror', None) or exc}") from exc
    return spec, (path.parent / workdir).resolve() if workdir else None


def run(
    spec_file: Annotated[Path, typer.Argument(
        help="Job file: the POST /v1/jobs body as YAML, plus `workdir` and `requirements_file`.")],
    name: Annotated[str | None, typer.Option(help="Override the file's name.")] = None,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Follow its logs and progress until it ends.")] = False,
    idempotency_key: Annotated[str | None, typer.Option(
        help="Submit at most once per key (default: a new one per run).")] = None,
    url: Url = None, token_file: TokenFile = None,
) -> None:
    """Submit a job from a file; its code is shipped from `workdir` when the file names one."""
    body, workdir = load_spec(spec_file)
    if name:
        body["name"] = name
    api = Api.from_options(url, token_file)
    if workdir is not None:
        from trainyard.cli.code_ship import ship

        body["code"] = ship(api, workdir, body.get("tenant"))
    job = api.post("/v1/jobs", body, headers={"Idempotency-Key": idempotency_key or str(uuid.uuid4())})
    print(f"job {job['name']} {job['id']} {job['state']}", file=sys.stderr)
    print(job["id"], flush=True)
    if follow:
        raise typer.Exit(_follow(api, job, rank=None, attempt=None))


def ps(
    all_: Annotated[bool, typer.Option("--all", "-a", help="Ended jobs too.")] = False,
    state: Annotated[list[str] | None, typer.Option(help="Only jobs in this state (repeatable).")] = None,
    tenant: Annotated[list[str] | None, typer.Option(help="Only this tenant's jobs (repeatable).")] = None,
    name: Annotated[str | None, typer.Option(help="Only jobs of this name.")] = None,
    limit: Annotated[int, typer.Option(min=1, max=10_000, help="At most this many jobs.")] = 50,
    output: Format = OutputFormat.table, url: Url = None, token_file: TokenFile = None,
) -> None:
    """Jobs, newest first: state (a recovery shows as recovering), step of total, step rate, ETA, loss, GPUs,
    age, and what a job that is not running waits for."""
    api = Api.from_options(url, token_file)
    states = state or (None if all_ else list(ACTIVE))
    jobs = list(api.pages("/v1/jobs", most=limit, state=states, tenant=tenant, name=name, limit=min(limit, 500)))
    if output is OutputFormat.json:
        print(json.dumps(jobs, indent=2))
        return
    if not jobs:
        print("no jobs" + ("" if all_ or state else " running or waiting (--all shows ended ones)"), file=sys.stderr)
        return
    job_view.print_to(_console(), job_view.jobs_table(jobs))


def describe(job_ref: JobRef, events: Annotated[int, typer.Option(help="Show the last N events.")] = 15,
             url: Url = None, token_file: TokenFile = None) -> None:
    """A job: progress, allocation, its attempts as a timeline (why each ended, how each recovery went),
    checkpoints, recent events."""
    api = Api.from_options(url, token_file)
    job = api.find_job(job_ref)
    attempts = list(api.pages(f"/v1/jobs/{job['id']}/attempts", most=200, limit=100))
    checkpoints = api.get(f"/v1/jobs/{job['id']}/checkpoints", limit=10)["items"]
    recent = list(api.pages(f"/v1/jobs/{job['id']}/events", most=5000, limit=1000))[-events:] if events else []
    job_view.print_to(_console(), job_view.describe(job, attempts, checkpoints, recent))


def logs(
    job_ref: JobRef,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep following until the job ends.")] = False,
    rank: Annotated[int | None, typer.Option(min=0, help="Only this global rank.")] = None,
    attempt: Annotated[int | None, typer.Option(min=1, help="Only this attempt (default: all).")] = None,
    stream: Annotated[str | None, typer.Option(help="stdout or stderr (default: both).")] = None,
    url: Url = None, token_file: TokenFile = None,
) -> None:
    """A job's worker logs, each line prefixed with its attempt, node rank and rank; -f follows them with live
    progress (on a terminal) and ends with the job, exit status 1 when it failed."""
    api = Api.from_options(url, token_file)
    job = api.find_job(job_ref)
    if not follow:
        for line in api.stream_lines(f"/v1/jobs/{job['id']}/logs", rank=rank, attempt=attempt, stream=stream):
            print(line, flush=True)
        return
    raise typer.Exit(_follow(api, job, rank=rank, attempt=attempt, stream=stream))


class _JobEvents:
    """A followed job's failures and recoveries, as they happen: the events API polled with
    ``after`` beside the log stream, each event that job_view.event_line names printed on stderr
    as one ``trainyard:`` line (the logs stay alone on stdout)."""

    def __init__(self, api: Api, job_id: str, say: Any) -> None:
        self.api, self.job_id, self.say = api, job_id, say
        self.after = 0
        self.done = threading.Event()
        self._lock = threading.Lock()  # the last poll, after the logs end, may meet the thread's

    def poll(self) -> None:
        with self._lock:
            while True:
                try:
                    page = self.api.get(f"/v1/jobs/{self.job_id}/events", after=self.after, limit=500)
                except ApiError:
                    return  # the next poll tries again; following the logs goes on
                for event in page["items"]:
                    self.after = max(self.after, int(event["id"]))
                    line = job_view.event_line(event)
                    if line is not None:
                        self.say(f"trainyard: {line}")
                if len(page["items"]) < 500:
                    return

    def __enter__(self) -> _JobEvents:
        def run() -> None:
            while not self.done.wait(EVENT_POLL_S):
                self.poll()
        threading.Thread(target=run, daemon=True, name="job-events").start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.poll()  # what happened last (the failure that ended the job) before the last line


EVENT_POLL_S = 2.0
"""How often a followed job's events are polled."""


def _follow(api: Api, job: dict[str, Any], *, rank: int | None, attempt: int | None, stream: str | None = None) -> int:
    """Follow a job's logs until it ends, with a live progress line on a terminal and a line for each
    failure and recovery (_JobEvents); the exit status."""
    console = Console(stderr=True)
    lines = api.stream_lines(f"/v1/jobs/{job['id']}/logs", follow="true", rank=rank, attempt=attempt, stream=stream)
    if console.is_terminal:
        with _JobEvents(api, job["id"], lambda line: console.print(line, style="magenta", markup=False,
                                                                  highlight=False, soft_wrap=True)):
            _follow_live(api, job, lines, console)
    else:
        with _JobEvents(api, job["id"], lambda line: print(line, file=sys.stderr, flush=True)):
            for line in lines:
                print(line, flush=True)
    final = job_view.shown(api.get(f"/v1/jobs/{job['id']}"))
    p = final["progress"]
    console.print(f"job {final['name']} {final['state']} at step {job_view.step_of(p)}"
                  + (f": {final['end_reason']}" if final.get("end_reason") and final["state"] != "succeeded" else ""),
                  highlight=False)
    return 0 if final["state"] == "succeeded" else 1


def _follow_live(api: Api, job: dict[str, Any], lines: Any, console: Console) -> None:
    from rich.live import Live
    from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn

    bar = Progress(TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(),
                   TextColumn("{task.fields[rate]} {task.fields[metrics]}"), TimeRemainingColumn(), console=console)
    task = bar.add_task(job["name"], total=None, rate="", metrics="")
    done = threading.Event()

    def poll() -> None:
        while not done.wait(2.0):
            try:
                now = job_view.shown(api.get(f"/v1/jobs/{job['id']}"))
            except ApiError:
                continue
            p = now["progress"]
            bar.update(task, completed=p.get("step") or 0, total=p.get("total_steps"),
                       description=f"{now['name']} {job_view.shown_state(now)}", rate=job_view.rate(p),
                       metrics=job_view.metrics_line(p, most=2))

    threading.Thread(target=poll, daemon=True).start()
    try:
        with Live(bar, console=console, transient=True, refresh_per_second=2):
            for line in lines:
                console.print(line, markup=False, highlight=False, soft_wrap=True)
    finally:
        done.set()


def cancel(job_ref: JobRef, url: Url = None, token_file: TokenFile = None) -> None:
    """Stop a job's workers (TERM, then KILL after a grace period)."""
    api = Api.from_options(url, token_file)
    job = api.find_job(job_ref)
    done = api.post(f"/v1/jobs/{job['id']}/cancel")
    print(f"job {done['name']} {done['id']} {done['state']}", file=sys.stderr)


@nodes_app.callback()
def nodes_list(ctx: typer.Context, output: Format = OutputFormat.table, url: Url = None,
               token_file: TokenFile = None) -> None:
    """Nodes: state, cordon/drain, GPUs and those in use, last heartbeat, labels."""
    if ctx.invoked_subcommand is None:
        _list(Api.from_options(url, token_file).get("/v1/nodes"), output, job_view.nodes_table)


def _list(doc: Any, output: OutputFormat, table: Any) -> None:
    """A listing on stdout: a table, or the API's JSON with ``--output json``."""
    if output is OutputFormat.json:
        print(json.dumps(doc, indent=2))
    else:
        job_view.print_to(_console(), table(doc))


def _node_action(action: str, node: str, url: str | None, token_file: Path | None) -> None:
    api = Api.from_options(url, token_file)
    found = api.find_node(node)
    out = api.post(f"/v1/nodes/{found['id']}/{action}")
    print(f"node {out['name']}: {out['scheduling']}", file=sys.stderr)


NodeRef = Annotated[str, typer.Argument(help="Node name or id.")]


@nodes_app.command("cordon")
def nodes_cordon(node: NodeRef, url: Url = None, token_file: TokenFile = None) -> None:
    """No new work on the node; its running jobs keep running."""
    _node_action("cordon", node, url, token_file)


@nodes_app.command("drain")
def nodes_drain(node: NodeRef, url: Url = None, token_file: TokenFile = None) -> None:
    """No new work; shows 'drained' once its running jobs are over."""
    _node_action("drain", node, url, token_file)


@nodes_app.command("uncordon")
def nodes_uncordon(node: NodeRef, url: Url = None, token_file: TokenFile = None) -> None:
    """The node takes new work again."""
    _node_action("uncordon", node, url, token_file)


@tenants_app.callback()
def tenants_list(ctx: typer.Context, output: Format = OutputFormat.table, url: Url = None,
                 token_file: TokenFile = None) -> None:
    """Tenants: weight, GPU quota, priority cap, GPUs in use, jobs waiting and running."""
    if ctx.invoked_subcommand is None:
        _list(Api.from_options(url, token_file).get("/v1/tenants"), output, job_view.tenants_table)


@tenants_app.command("set")
def tenants_set(
    name: str,
    weight: Annotated[float, typer.Option(help="Share of the queue.")] = 1.0,
    gpu_quota: Annotated[int | None, typer.Option(help="GPUs its jobs may hold at once.")] = None,
    max_priority: Annotated[int, typer.Option(help="Highest priority its members may give.")] = 0,
    url: Url = None, token_file: TokenFile = None,
) -> None:
    """Create or replace a tenant's weight, quota and priority cap."""
    out = Api.from_options(url, token_file).request(
        "PUT", f"/v1/tenants/{name}", body={"weight": weight, "gpu_quota": gpu_quota, "max_priority": max_priority})
    print(f"tenant {out['name']}: weight {out['weight']}, quota {out['gpu_quota']}, max priority "
          f"{out['max_priority']}", file=sys.stderr)
