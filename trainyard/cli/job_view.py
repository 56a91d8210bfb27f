"""How the CLI shows jobs, attempts and nodes (rich tables); pure functions of the API's JSON."""

from __future__ import annotations

import shlex
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from typing import Any, TypeVar, cast

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from trainyard.protocol.display import duration, printable_data

T = TypeVar("T")

STATE_STYLE = {"queued": "yellow", "starting": "cyan", "running": "green", "recovering": "magenta",
               "succeeded": "bold green", "failed": "bold red", "cancelling": "yellow", "cancelled": "dim"}
ENDED = ("succeeded", "failed", "cancelled")


def parse_time(value: str | None) -> datetime | None:
    return datetime.fromisoformat(value) if value else None


def age(value: str | None, now: datetime | None = None) -> str:
    at = parse_time(value)
    return "-" if at is None else duration(((now or datetime.now(UTC)) - at).total_seconds())


def when(value: str | None, now: datetime | None = None) -> str:
    """A time as a person reads it in a listing: "3m05s ago", or "in 2h03m" for one to come."""
    at = parse_time(value)
    if at is None:
        return "-"
    seconds = ((now or datetime.now(UTC)) - at).total_seconds()
    return f"{duration(seconds)} ago" if seconds >= 0 else f"in {duration(-seconds)}"


def step_of(progress: dict[str, Any]) -> str:
    step, total = progress.get("step"), progress.get("total_steps")
    if step is None:
        return "-"
    return f"{step}/{total}" if total else str(step)


def rate(progress: dict[str, Any]) -> str:
    value = progress.get("steps_per_s")
    if not value:
        return "-"
    return f"{value:.2f}/s" if value < 10 else f"{value:.0f}/s"


def metrics_line(progress: dict[str, Any], most: int = 4) -> str:
    parts = []
    if progress.get("loss") is not None:
        parts.append(f"loss {progress['loss']:.4g}")
    for key, value in sorted((progress.get("metrics") or {}).items())[:most]:
        parts.append(f"{key} {value:.4g}")
    return ", ".join(parts)


def state_text(state: str) -> Text:
    return Text(state, style=STATE_STYLE.get(state, ""))


def shown(data: T) -> T:
    """What the server sent, safe to print: a job's error, log or metric name written by its code
    cannot drive the terminal (trainyard/protocol/display.py printable)."""
    return cast(T, printable_data(data))


def shown_state(job: dict[str, Any]) -> str:
    """The state a person would name: a job starting its second or later attempt is recovering
    (the API's state is ``starting``, as for a first start)."""
    current = job.get("current_attempt") or {}
    if job["state"] == "starting" and (current.get("number") or 1) > 1:
        return "recovering"
    return str(job["state"])


def jobs_table(jobs: Sequence[dict[str, Any]], now: datetime | None = None) -> Table:
    jobs = shown(list(jobs))
    table = Table(box=None, pad_edge=False, header_style="bold")
    waits = any(job.get("waiting_for") for job in jobs)
    columns = ("ID", "NAME", "TENANT", "STATE", "STEP", "RATE", "ETA", "LOSS", "GPUS", "AGE")
    for column in columns:
        table.add_column(column, no_wrap=True, justify="right" if column in ("STEP", "RATE", "ETA", "GPUS") else "left")
    if waits:  # what a waiting, starting or recovering job waits for (issue 26)
        table.add_column("WAITING FOR", overflow="fold")
    for job in jobs:
        p = job["progress"]
        loss = "-" if p.get("loss") is None else f"{p['loss']:.4g}"
        gpus = f"{job['num_nodes']}x{job['gpus_per_node']}"
        row: list[Any] = [job["id"][:8], job["name"], job["tenant"], state_text(shown_state(job)), step_of(p), rate(p),
                          duration(p.get("eta_s")) if p.get("eta_s") is not None else "-", loss, gpus,
                          age(job["created_at"], now)]
        table.add_row(*row, *([job.get("waiting_for") or ""] if waits else []))
    return table


def event_line(event: dict[str, Any]) -> str | None:
    """The line a followed job (``run -f``, ``logs -f``) prints for one of its events as it happens:
    an attempt that failed and why, a recovery that starts, the checkpoint step it resumes from, a
    recovered job running again; None for the others (the end is said once, by the last line)."""
    event = shown(event)
    kind, message = event["kind"], event["message"]
    first = message.startswith("attempt 1 ") or message.startswith("attempt 1:")
    if kind == "job.recovering":  # "attempt N failed (<cause>); recovery k of m"
        return message
    if kind == "job.starting" and not first:
        return f"recovery: {message}"
    if kind == "checkpoint.restored" and isinstance(event.get("data", {}).get("step"), int):
        step, attempt = event["data"]["step"], message.split(" restored", 1)[0]  # "attempt N restored step S"
        return f"recovery: {attempt} resumes from checkpoint step {step} (next step {step + 1})"
    if kind == "checkpoint.fallback":
        return f"recovery: {message}"
    if kind == "job.running" and not first:
        return f"recovered: {message}"
    return None


def _kv(rows: Iterable[tuple[str, Any]]) -> Table:
    table = Table(box=None, show_header=False, pad_edge=False)
    table.add_column(style="bold", no_wrap=True)
    table.add_column()
    for key, value in rows:
        if value not in (None, "", [], {}):
            table.add_row(key, value if isinstance(value, Text) else str(value))
    return table


def attempt_lines(attempts: Sequence[dict[str, Any]]) -> list[Text]:
    """The attempts as a timeline: when each ran, how it ended and why, how its recovery went."""
    lines = []
    for a in attempts:
        start, end = parse_time(a.get("created_at")), parse_time(a.get("ended_at") or a.get("failed_at"))
        ran = duration((end - start).total_seconds()) if start and end else "running"
        outcome = a.get("outcome") or a["state"]
        line = Text(f"#{a['number']} ", style="bold")
        line.append(f"{outcome:<9}", style=STATE_STYLE.get(outcome, ""))
        line.append(f" {start:%H:%M:%S} " if start else " ")
        line.append(f"{ran:>8}")
        steps = a.get("progress_step")
        if a.get("restored_from_step") is not None:
            line.append(f"  steps {a['restored_from_step']}->{steps if steps is not None else '?'}")
        elif steps is not None:
            line.append(f"  steps 0->{steps}")
        nodes = ", ".join(f"{p['node_name']}{p['gpu_indices']}" for p in a.get("nodes", []))
        if nodes:
            line.append(f"  on {nodes}", style="dim")
        lines.append(line)
        recovery = a.get("recovery")
        if recovery:
            lines.append(_recovery_line(recovery))
        if a.get("end_reason") and a.get("outcome") != "succeeded":
            kind = f"[{a['failure_kind']}] " if a.get("failure_kind") else ""
            lines.append(Text(f"    {kind}{a['end_reason']}", style="red" if a.get("outcome") == "failed" else ""))
    return lines


RECOVERY_PHASES = ("detection", "decision", "wake_up", "process_start", "rendezvous", "restore")


def _recovery_line(recovery: dict[str, Any]) -> Text:
    """Each phase of a recovery in order; a phase over its budget in red, with the budget."""
    over = {o["phase"]: o for o in recovery.get("over_budget") or []}
    line = Text(f"    recovery from #{recovery['after_attempt']}: ", style="magenta")
    shown = [p for p in RECOVERY_PHASES if recovery.get(f"{p}_s") is not None]
    for i, phase in enumerate(shown):
        seconds = recovery[f"{phase}_s"]
        if phase in over:
            line.append(f"{phase.replace('_', ' ')} {seconds:.2f}s (budget {over[phase]['budget_s']:g}s)", style="red")
        else:
            line.append(f"{phase.replace('_', ' ')} {seconds:.2f}s", style="magenta")
        if i < len(shown) - 1:
            line.append(" -> ", style="magenta")
    total, lost = recovery.get("to_first_step_s"), recovery.get("steps_lost")
    line.append((f" = {total:.2f}s" if total is not None else "")
                + (f", {lost} steps lost" if lost is not None else ""), style="magenta")
    return line


def checkpoint_line(block: dict[str, Any]) -> str | None:
    """The job's checkpoint settings in a line; None without an interval (no checkpoints)."""
    interval = block.get("interval_steps")
    if interval is None:
        return None
    every = "auto interval" if interval == "auto" else f"every {interval} steps"
    tier = "on" if block.get("memory_tier", True) is not False else "off (restores read S3)"
    return f"{every}, keep {block.get('keep_last', 3)}, memory tier {tier}"


def describe(job: dict[str, Any], attempts: Sequence[dict[str, Any]], checkpoints: Sequence[dict[str, Any]],
             events: Sequence[dict[str, Any]]) -> Group:
    job, attempts, checkpoints = shown(job), shown(list(attempts)), shown(list(checkpoints))
    events = shown(list(events))
    p = job["progress"]
    allocation = ", ".join(f"{a['node_name']} (rank {a['node_rank']}) GPUs {a['gpu_indices']}"
                           for a in job.get("allocation", []))
    head = _kv([
        ("Job", f"{job['name']}  {job['id']}"),
        ("State", state_text(shown_state(job))),
        ("Tenant", f"{job['tenant']} (priority {job['priority']})"),
        ("Command", shlex.join(job["command"])) if job.get("command") else
        ("Entrypoint", " ".join([job["entrypoint"], *job["args"]])),
        ("GPUs", f"{job['num_nodes']} nodes x {job['gpus_per_node']}"),
        ("Step", f"{step_of(p)}  {rate(p)}" + (f"  ETA {duration(p['eta_s'])}" if p.get("eta_s") is not None else "")),
        ("Metrics", metrics_line(p)),
        ("Checkpoints", checkpoint_line(job.get("checkpoint") or {})),
        ("Failures", f"{job['failures']} of {job['max_failures']} tolerated"),
        ("Waiting for", job.get("waiting_for")),
        ("Allocation", allocation),
        ("Result", job.get("result") and ", ".join(f"{k}={v}" for k, v in sorted(job["result"].items())
                                                   if not isinstance(v, dict))),
        ("End reason", job.get("end_reason")),
        ("Created", f"{job['created_at']} ({age(job['created_at'])} ago)"),
    ])
    parts: list[Any] = [head]
    if attempts:
        parts += [Text("\nAttempts", style="bold"), *attempt_lines(attempts)]
    if checkpoints:
        table = Table(box=None, pad_edge=False, header_style="bold", title_justify="left")
        for column in ("STEP", "STATE", "ATTEMPT", "SIZE", "COMMITTED"):
            table.add_column(column)
        for c in checkpoints[:10]:
            table.add_row(str(c["step"]), c["state"], f"#{c['attempt_number']}", f"{c['size_bytes'] / 1e6:.2f} MB",
                          c.get("committed_at") or "-")
        parts += [Text("\nCheckpoints", style="bold"), table]
    if events:
        parts.append(Text("\nEvents", style="bold"))
        for e in events:
            at = parse_time(e["created_at"])
            parts.append(Text(f"{at:%H:%M:%S} " if at else "", style="dim").append(f"{e['kind']:<24} ",
                                                                                   style="cyan").append(e["message"]))
    return Group(*parts)


def nodes_table(nodes: Sequence[dict[str, Any]], now: datetime | None = None) -> Table:
    nodes = shown(list(nodes))
    table = Table(box=None, pad_edge=False, header_style="bold")
    for column in ("NAME", "STATE", "SCHEDULING", "GPUS", "IN USE", "KIND", "HEARTBEAT", "LABELS"):
        table.add_column(column, no_wrap=True)
    for n in nodes:
        used = sum(1 for g in n["gpus"] if g.get("job_id"))
        kind = ", ".join(sorted({g["kind"] for g in n["gpus"]})) or "-"
        labels = ",".join(f"{k}={v}" for k, v in sorted(n.get("labels", {}).items()))
        style = "green" if n["state"] == "ready" else "red"
        table.add_row(n["name"], Text(n["state"], style=style), n["scheduling"], str(len(n["gpus"])), str(used), kind,
                      age(n.get("last_heartbeat_at"), now) + " ago" if n.get("last_heartbeat_at") else "-", labels)
    return table


def tenants_table(tenants: Sequence[dict[str, Any]]) -> Table:
    tenants = shown(list(tenants))
    table = Table(box=None, pad_edge=False, header_style="bold")
    keys = [k for k in ("name", "weight", "gpu_quota", "max_priority", "gpus_in_use", "jobs_waiting", "jobs_running")
            if any(k in t for t in tenants)] or ["name"]
    for key in keys:
        table.add_column(key.upper().replace("_", " "), no_wrap=True)
    for t in tenants:
        table.add_row(*("-" if t.get(k) is None else str(t.get(k)) for k in keys))
    return table


def records_table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str]]) -> Table:
    """A listing of API documents: ``columns`` are (header, key); times show as their age."""
    rows = shown(list(rows))
    table = Table(box=None, pad_edge=False, header_style="bold")
    for header, _ in columns:
        table.add_column(header, no_wrap=True)
    for row in rows:
        cells = []
        for _, key in columns:
            value = row.get(key)
            if value is None or value == "":
                cells.append("-")
            elif key.endswith("_at") and isinstance(value, str):
                cells.append(when(value))
            else:
                cells.append(str(value))
        table.add_row(*cells)
    return table


def key_values(doc: dict[str, Any]) -> Table:
    """One document as KEY value lines (whoami)."""
    return _kv((key, "-" if value is None else str(value)) for key, value in shown(doc).items())


def print_to(console: Console, renderable: Any) -> None:
    console.print(renderable, soft_wrap=False, overflow="fold")
