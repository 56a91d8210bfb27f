"""The CLI's side of the API: where the control plane is, the caller's token, and requests whose
failures are one line (the problem+json ``detail``).

Where the URL and the token come from, first found wins:

- URL: ``--url``, ``TRAINYARD_URL``, the config file, https://127.0.0.1:8000.
- the CA its certificate is verified with: ``TRAINYARD_CA_FILE``, the config file, else the
  system's trust store (trainyard/cli/tls.py).
- token: ``--token-file`` / ``TRAINYARD_TOKEN_FILE``, ``TRAINYARD_TOKEN``, the config file. Never
  an argument: other users of the machine see command lines in the process table.

The config file (``trainyard login`` writes it, mode 0600) is ``TRAINYARD_CONFIG``, else
``$XDG_CONFIG_HOME/trainyard/config.json``, else ``~/.config/trainyard/config.json``.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer

from trainyard.protocol.display import printable

DEFAULT_URL = "https://127.0.0.1:8000"
TOKEN_ENV = "TRAINYARD_TOKEN"
URL_ENV = "TRAINYARD_URL"
CONFIG_ENV = "TRAINYARD_CONFIG"

Url = Annotated[str | None, typer.Option("--url", envvar=URL_ENV, show_default=False,
                                         help="Control-plane URL (default: from `trainyard login`, else "
                                         f"{DEFAULT_URL}).")]
TokenFile = Annotated[Path | None, typer.Option(
    "--token-file", envvar="TRAINYARD_TOKEN_FILE", show_default=False,
    help="File holding your API token (default: TRAINYARD_TOKEN, else the token `trainyard login` stored).")]


class OutputFormat(StrEnum):
    table = "table"
    json = "json"


Format = Annotated[OutputFormat, typer.Option(
    "--output", "-o", help="table (default, for people) or json (the API's documents, for scripts).")]


class ApiError(Exception):
    """One line for the user; ``status`` is the HTTP status when the API answered."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def config_path() -> Path:
    if os.environ.get(CONFIG_ENV):
        return Path(os.environ[CONFIG_ENV])
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "trainyard" / "config.json"


def load_config() -> dict[str, Any]:
    path = config_path()
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise ApiError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ApiError(f"{path} is not a JSON object; run `trainyard login` again")
    if data.get("token") and stat.S_IMODE(path.stat().st_mode) & 0o077:
        raise ApiError(f"{path} holds a token and is readable by others; chmod 600 {path}")
    return data


def save_config(data: dict[str, Any]) -> Path:
    """Write the config file with mode 0600 (created so: never readable by others, even briefly)."""
    path = config_path()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(data, fh, indent=2)
    os.replace(tmp, path)
    return path


def read_token_file(path: Path) -> str:
    try:
        value = path.read_text().strip().splitlines()[0].strip() if path.read_text().strip() else ""
    except OSError as exc:
        raise ApiError(f"cannot read {path}: {exc.strerror or exc}") from exc
    if not value:
        raise ApiError(f"{path} is empty")
    return value


def resolve_url(url: str | None) -> str:
    return (url or os.environ.get(URL_ENV) or load_config().get("url") or DEFAULT_URL).rstrip("/")


def resolve_token(token_file: Path | None) -> str:
    if token_file is not None:
        return read_token_file(token_file)
    if os.environ.get(TOKEN_ENV, "").strip():
        return os.environ[TOKEN_ENV].strip()
    token = load_config().get("token")
    if not token:
        raise ApiError(f"no token: run `trainyard login URL`, set {TOKEN_ENV} or pass a file with --token-file")
    return str(token)


def verify_context() -> Any:
    """What the control plane's certificate is verified with (an ssl.SSLContext)."""
    from trainyard.cli.tls import CA_FILE_ENV, client_context

    return client_context(os.environ.get(CA_FILE_ENV) or load_config().get("ca_file") or None)


def problem_detail(response: Any) -> str:
    try:
        problem = response.json()
        detail = problem.get("detail") or problem.get("title")
    except (ValueError, AttributeError):
        detail = None
    return " ".join(str(detail or response.text[:200] or response.reason_phrase).split())


@dataclass
class Api:
    """A control plane and a token; every failure raises ApiError with one line."""

    url: str
    token: str
    timeout_s: float = 30.0
    ca_file: str | None = None
    """The CA to verify the control plane with; None: verify_context()'s."""

    @classmethod
    def from_options(cls, url: str | None, token_file: Path | None) -> Api:
        return cls(resolve_url(url), resolve_token(token_file))

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    @property
    def verify(self) -> Any:
        if self.ca_file is not None:
            from trainyard.cli.tls import client_context

            return client_context(self.ca_file)
        return verify_context()

    def unreachable(self, exc: BaseException, doing: str = "cannot reach") -> ApiError:
        from trainyard.cli.tls import untrusted

        return ApiError(f"{doing} the control plane at {self.url}: {untrusted(exc) or exc or type(exc).__name__}")

    def request(self, method: str, path: str, *, body: Any = None, params: Any = None,
                headers: dict[str, str] | None = None) -> Any:
        import httpx

        try:
            response = httpx.request(method, self.url + path, json=body, params=params, timeout=self.timeout_s,
                                     headers={**self.headers, **(headers or {})}, verify=self.verify)
        except httpx.HTTPError as exc:
            raise self.unreachable(exc) from exc
        if response.status_code >= 400:
            raise ApiError(f"{response.status_code}: {problem_detail(response)}", response.status_code)
        try:
            return response.json()
        except ValueError as exc:
            raise ApiError(f"the control plane at {self.url} did not answer JSON") from exc

    def get(self, path: str, **params: Any) -> Any:
        return self.request("GET", path, params={k: v for k, v in params.items() if v is not None})

    def post(self, path: str, body: Any = None, headers: dict[str, str] | None = None) -> Any:
        return self.request("POST", path, body=body, headers=headers)

    def pages(self, path: str, *, most: int = 10_000, **params: Any) -> Iterator[Any]:
        """Every item of a paginated collection ({items, next_cursor}), at most ``most``."""
        cursor, seen = None, 0
        while True:
            page = self.get(path, cursor=cursor, **params)
            for item in page["items"]:
                yield item
                seen += 1
                if seen >= most:
                    return
            cursor = page.get("next_cursor")
            if not cursor:
                return

    def stream_lines(self, path: str, **params: Any) -> Iterator[str]:
        """A streamed text answer (followed logs), line by line, with control characters written out
        (a worker's output must not drive the reader's terminal)."""
        import httpx

        try:
            with httpx.stream("GET", self.url + path, params={k: v for k, v in params.items() if v is not None},
                              headers=self.headers, timeout=httpx.Timeout(self.timeout_s, read=None),
                              verify=self.verify) as response:
                if response.status_code >= 400:
                    response.read()
                    raise ApiError(f"{response.status_code}: {problem_detail(response)}", response.status_code)
                for line in response.iter_lines():
                    yield printable(line)
        except httpx.HTTPError as exc:
            raise self.unreachable(exc, "lost") from exc

    def find_job(self, ref: str) -> dict[str, Any]:
        """A job by id, by name (the newest of that name), or by a prefix of its id (8+ characters)."""
        import uuid

        try:
            uuid.UUID(ref)
        except ValueError:
            pass
        else:
            return dict(self.get(f"/v1/jobs/{ref}"))
        named = self.get("/v1/jobs", name=ref, limit=1)["items"] if len(ref) <= 128 else []
        if named:
            return dict(named[0])
        if len(ref) >= 8 and all(c in "0123456789abcdef-" for c in ref.lower()):
            found = [j for j in self.pages("/v1/jobs", most=2000, limit=500) if j["id"].startswith(ref.lower())]
            if len(found) == 1:
                return dict(found[0])
            if len(found) > 1:
                raise ApiError(f"{ref} is the start of {len(found)} job ids; give more of it")
        raise ApiError(f"no job named {ref!r} (nor with that id)")

    def find_node(self, ref: str) -> dict[str, Any]:
        nodes = self.get("/v1/nodes")
        for node in nodes:
            if ref in (node["id"], node["name"]):
                return dict(node)
        raise ApiError(f"no node named {ref!r} (nor with that id)")
