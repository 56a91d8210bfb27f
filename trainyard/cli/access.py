"""``trainyard principals|tokens|join-tokens|whoami``: who may use the cluster, over its API.

The caller's token comes from ``TRAINYARD_TOKEN`` or a file (``--token-file`` /
``TRAINYARD_TOKEN_FILE``), never from the command line, where other users of the machine would
see it in the process table. A token the API creates is printed once, on stdout, alone on its line
(or written to ``--output`` with mode 0600): everything else goes to stderr.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from trainyard.cli import api_client

principals_app = typer.Typer(help="Principals (people, CI systems) with a tenant and a role.", no_args_is_help=True)
tokens_app = typer.Typer(help="API tokens: create (shown once), list, revoke.", no_args_is_help=True)
join_app = typer.Typer(help="Join tokens for node agents (operators).", no_args_is_help=True)

Url = api_client.Url
Format = api_client.Format
PRINCIPAL_COLUMNS = (("NAME", "name"), ("TENANT", "tenant"), ("ROLE", "role"), ("TOKENS", "tokens"),
                     ("CREATED", "created_at"), ("BY", "created_by"), ("DISABLED", "disabled_at"))
TOKEN_COLUMNS = (("ID", "id"), ("PRINCIPAL", "principal"), ("DESCRIPTION", "description"), ("CREATED", "created_at"),
                 ("EXPIRES", "expires_at"), ("LAST USED", "last_used_at"), ("REVOKED", "revoked_at"))
JOIN_COLUMNS = (("ID", "id"), ("NODE", "node_name"), ("USES", "uses"), ("MAX USES", "max_uses"),
                ("DESCRIPTION", "description"), ("EXPIRES", "expires_at"), ("REVOKED", "revoked_at"))
TokenFile = Annotated[Path | None, typer.Option(
    "--token-file", envvar="TRAINYARD_TOKEN_FILE", show_default=False,
    help="File holding your API token (default: the TRAINYARD_TOKEN variable).")]


class AccessError(Exception):
    """One line for the user (trainyard.cli prints it)."""


def read_secret(path: Path | None, env: str) -> str:
    """A secret from a file (first line, whitespace stripped) or else the environment variable (for
    TRAINYARD_TOKEN: else the token ``trainyard login`` stored)."""
    if env == "TRAINYARD_TOKEN":
        try:
            return api_client.resolve_token(path)
        except api_client.ApiError as exc:
            raise AccessError(str(exc)) from exc
    if path is not None:
        try:
            value = path.read_text().strip()
        except OSError as exc:
            raise AccessError(f"cannot read {path}: {exc.strerror or exc}") from exc
        if not value:
            raise AccessError(f"{path} is empty")
        return value
    value = os.environ.get(env, "").strip()
    if not value:
        raise AccessError(f"no token: set {env} or pass a file with --token-file")
    return value


def call(url: str | None, token_file: Path | None, method: str, path: str, body: dict[str, Any] | None = None,
         params: dict[str, Any] | None = None) -> Any:
    import httpx

    from trainyard.cli.tls import untrusted

    token = read_secret(token_file, "TRAINYARD_TOKEN")
    url = api_client.resolve_url(url)
    try:
        resp = httpx.request(method, url + path, json=body, params=params, timeout=30,
                             headers={"Authorization": f"Bearer {token}"}, verify=api_client.verify_context())
    except httpx.HTTPError as exc:
        raise AccessError(f"cannot reach {url}: {untrusted(exc) or exc}") from exc
    if resp.status_code >= 400:
        try:
            problem = resp.json()
            detail = problem.get("detail") or problem.get("title")
        except ValueError:
            detail = resp.text[:200]
        raise AccessError(f"HTTP {resp.status_code}: {detail}")
    return resp.json()


def _show(doc: Any) -> None:
    print(json.dumps(doc, indent=2), file=sys.stderr)


def _listing(doc: Any, output: api_client.OutputFormat, columns: tuple[tuple[str, str], ...]) -> None:
    """A listing on stdout: a table for people, or the API's JSON with ``--output json``."""
    from rich.console import Console

    from trainyard.cli import job_view

    if output is api_client.OutputFormat.json:
        print(json.dumps(doc, indent=2))
    elif not doc:
        print("none", file=sys.stderr)
    else:
        job_view.print_to(Console(width=None if sys.stdout.isatty() else 200, highlight=False),
                          job_view.records_table(doc, columns) if isinstance(doc, list) else job_view.key_values(doc))


def _secret_out(token: str, output: Path | None) -> None:
    if output is None:
        print(token, flush=True)
        return
    fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(token + "\n")
    os.chmod(output, 0o600)
    print(f"token written to {output} (mode 0600)", file=sys.stderr)


Output = Annotated[Path | None, typer.Option(help="Write the new token to this file (0600) instead of stdout.",
                                             show_default=False)]


@principals_app.command("create")
def principals_create(
    name: str, tenant: Annotated[str, typer.Option(help="Its team.")],
    role: Annotated[str, typer.Option(help="admin, operator, member or viewer.")] = "member",
    token_ttl_s: Annotated[int | None, typer.Option(help="Lifetime of its first token.")] = None,
    output: Output = None, url: Url = None, token_file: TokenFile = None,
) -> None:
    """Create a principal; its first token is printed once."""
    doc = call(url, token_file, "POST", "/v1/principals",
               {"name": name, "tenant": tenant, "role": role, "token_ttl_s": token_ttl_s})
    token = doc.pop("token")
    _show(doc)
    _secret_out(token, output)


@principals_app.command("list")
def principals_list(output: Format = api_client.OutputFormat.table, url: Url = None,
                    token_file: TokenFile = None) -> None:
    """Principals: tenant, role, live tokens."""
    _listing(call(url, token_file, "GET", "/v1/principals"), output, PRINCIPAL_COLUMNS)


@principals_app.command("disable")
def principals_disable(name: str, url: Url = None, token_file: TokenFile = None) -> None:
    """Revoke every token of the principal and refuse it from now on."""
    _show(call(url, token_file, "DELETE", f"/v1/principals/{name}"))


@tokens_app.command("create")
def tokens_create(
    principal: Annotated[str | None, typer.Option(help="Whose (admins); default: yours.")] = None,
    description: Annotated[str, typer.Option(help="What it is for.")] = "",
    ttl_s: Annotated[int | None, typer.Option(help="Lifetime in seconds; default: until revoked.")] = None,
    output: Output = None, url: Url = None, token_file: TokenFile = None,
) -> None:
    """Create an API token; printed once."""
    doc = call(url, token_file, "POST", "/v1/tokens",
               {"principal": principal, "description": description, "ttl_s": ttl_s})
    token = doc.pop("token")
    _show(doc)
    _secret_out(token, output)


@tokens_app.command("list")
def tokens_list(principal: Annotated[str | None, typer.Option(help="Whose (admins).")] = None,
                output: Format = api_client.OutputFormat.table, url: Url = None, token_file: TokenFile = None) -> None:
    """API tokens (never the secrets): when each expires, was last used, was revoked."""
    params = {"principal": principal} if principal else None
    _listing(call(url, token_file, "GET", "/v1/tokens", params=params), output, TOKEN_COLUMNS)


@tokens_app.command("revoke")
def tokens_revoke(token_id: str, url: Url = None, token_file: TokenFile = None) -> None:
    _show(call(url, token_file, "DELETE", f"/v1/tokens/{token_id}"))


@join_app.command("create")
def join_create(
    node: Annotated[str | None, typer.Option(help="Only this node name; it may also re-claim that node.")] = None,
    ttl_s: Annotated[int, typer.Option(help="Lifetime in seconds.")] = 3600,
    uses: Annotated[int, typer.Option(help="Registrations it allows (0: any until it expires).")] = 1,
    description: Annotated[str, typer.Option(help="What it is for.")] = "",
    output: Output = None, url: Url = None, token_file: TokenFile = None,
) -> None:
    """Create a join token for an agent (give it the file: trainyard agent --join-token-file)."""
    doc = call(url, token_file, "POST", "/v1/join-tokens", {
        "node_name": node, "ttl_s": ttl_s, "max_uses": uses or None, "description": description})
    token = doc.pop("token")
    _show(doc)
    _secret_out(token, output)


@join_app.command("list")
def join_list(output: Format = api_client.OutputFormat.table, url: Url = None, token_file: TokenFile = None) -> None:
    """Join tokens: the node each is for, uses, expiry."""
    _listing(call(url, token_file, "GET", "/v1/join-tokens"), output, JOIN_COLUMNS)


@join_app.command("revoke")
def join_revoke(token_id: str, url: Url = None, token_file: TokenFile = None) -> None:
    _show(call(url, token_file, "DELETE", f"/v1/join-tokens/{token_id}"))


def whoami(output: Format = api_client.OutputFormat.table, url: Url = None, token_file: TokenFile = None) -> None:
    """Your principal: name, tenant, role."""
    _listing(call(url, token_file, "GET", "/v1/whoami"), output, ())
