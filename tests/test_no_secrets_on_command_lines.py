"""No secret is ever an argument (issue 11, finding 2): other users of a machine see every command
line (ps, /proc/PID/cmdline). Built from the command trees themselves, so a new option named like a
secret that takes its value inline fails here until it takes a file (or is allow-listed below, with
the reason it is no secret)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import typer

from node_agent.options import build_parser
from trainyard.cli import app

SECRET_LIKE = re.compile(r"token|secret|passw(or)?d|key|credential|auth|cookie", re.IGNORECASE)

NOT_SECRETS = {
    ("run", "--idempotency-key"): "a request's idempotency key: the caller's own label for one submit",
    ("principals create", "--token-ttl-s"): "a lifetime in seconds",
    ("dev up", "--s3-access-key"): "the access key's id, an identifier like a user name (AWS shows it in "
                                   "logs and ARNs); its secret comes from --s3-secret-key-file or the environment",
    ("tokens revoke", "token_id"): "a token's id as `tokens list` shows it, not the token",
    ("join-tokens revoke", "token_id"): "a join token's id, not the token",
}
"""(command, option or argument) -> why it is not a secret."""


def _typer_params(command: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[str, str, Any]]:
    if hasattr(command, "commands"):
        for name, sub in command.commands.items():
            yield from _typer_params(sub, (*path, name))
        return
    for param in command.params:
        names = param.opts if param.param_type_name == "option" else [param.name]
        for name in names:
            yield " ".join(path), name, param


def _takes_a_file(name: str, param: Any) -> bool:
    return name.endswith(("-file", "_file")) or type(param.type).__name__ in ("TyperPath", "Path") or bool(
        getattr(param, "is_flag", False))


def test_no_cli_option_takes_a_secret_inline() -> None:
    root = typer.main.get_command(app)
    seen = list(_typer_params(root))
    assert len({command for command, _, _ in seen}) > 20  # the whole tree was walked
    inline = [f"trainyard {command} {name}" for command, name, param in seen
              if SECRET_LIKE.search(name) and not _takes_a_file(name, param) and (command, name) not in NOT_SECRETS]
    assert inline == [], "secrets must come from a file or the environment, never an argument"
    # The allow-list names only what exists: a renamed option must not leave a stale exemption.
    assert set(NOT_SECRETS) <= {(command, name) for command, name, _ in seen}


def test_the_agents_own_parser_takes_no_secret_inline() -> None:
    actions = build_parser()._actions
    names = [option for action in actions for option in action.option_strings]
    assert "--join-token-file" in names and "--control-plane" in names
    # A key or token named by its path (a file, like the CLI's Path options) is not inline.
    inline = [option for action in actions for option in action.option_strings
              if SECRET_LIKE.search(option) and not option.endswith("-file") and action.nargs != 0
              and action.type is not Path]
    assert inline == []
    assert next(a for a in actions if "--memory-tls-key" in a.option_strings).type is Path


def test_dev_up_reads_its_secrets_from_files_or_the_environment(tmp_path: Any, monkeypatch: Any) -> None:
    """The token and the S3 secret reach dev up's config from a file or a variable (the config is
    built and refused for a missing endpoint part, before anything starts)."""
    from trainyard.cli import main

    seen: dict[str, Any] = {}

    def fake_run(config: Any) -> int:
        seen.update(token=config.token, secret=config.s3_secret_key, access=config.s3_access_key)
        return 0

    monkeypatch.setattr("trainyard.dev.run_dev_up", fake_run)
    token = tmp_path / "admin.token"
    token.write_text("from-a-file\n")
    secret = tmp_path / "s3.secret"
    secret.write_text("s3-secret-from-a-file\n")
    monkeypatch.delenv("TRAINYARD_TOKEN", raising=False)
    monkeypatch.delenv("TRAINYARD_S3_SECRET_KEY", raising=False)
    args = ["dev", "up", "--data-dir", str(tmp_path / "d"), "--s3-endpoint", "127.0.0.1:9", "--s3-access-key", "ak"]
    try:
        main([*args, "--token-file", str(token), "--s3-secret-key-file", str(secret)])
    except SystemExit as exc:
        assert exc.code == 0
    assert seen == {"token": "from-a-file", "secret": "s3-secret-from-a-file", "access": "ak"}
    monkeypatch.setenv("TRAINYARD_TOKEN", "from-the-env")
    monkeypatch.setenv("TRAINYARD_S3_SECRET_KEY", "s3-secret-from-the-env")
    try:
        main(args)
    except SystemExit as exc:
        assert exc.code == 0
    assert seen == {"token": "from-the-env", "secret": "s3-secret-from-the-env", "access": "ak"}
