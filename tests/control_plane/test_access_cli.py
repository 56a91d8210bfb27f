"""The access commands of the CLI against a real control plane (uvicorn, real PostgreSQL): tokens
from the environment or a file, never the command line; a new token printed once, or written
0600."""

from __future__ import annotations

import json
import stat

import pytest

from control_plane.app import create_app
from tests.control_plane.helpers import serve
from tests.factories import ADMIN_TOKEN
from trainyard.cli import main


def _run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as done:
        main(args)
    out, err = capsys.readouterr()
    return int(done.value.code or 0), out, err


def test_principals_tokens_and_join_tokens_from_the_cli(settings, tmp_path, monkeypatch, capsys):
    with serve(create_app(settings)) as url:
        monkeypatch.setenv("TRAINYARD_URL", url)
        monkeypatch.setenv("TRAINYARD_TOKEN", ADMIN_TOKEN)
        code, out, err = _run(["principals", "create", "alice", "--tenant", "vision", "--role", "member"], capsys)
        assert code == 0, err
        token = out.strip()
        assert token.startswith("tyt_") and token not in err and json.loads(err)["role"] == "member"

        token_file = tmp_path / "alice.token"
        token_file.write_text(token + "\n")
        monkeypatch.delenv("TRAINYARD_TOKEN")
        code, out, err = _run(["whoami", "--token-file", str(token_file), "--output", "json"], capsys)
        assert code == 0 and json.loads(out) == {"name": "alice", "tenant": "vision", "role": "member",
                                                 "token_id": json.loads(out)["token_id"]}
        # People get a table by default, like every other listing.
        code, out, err = _run(["whoami", "--token-file", str(token_file)], capsys)
        assert code == 0 and {"name alice", "tenant vision", "role member"} <= {" ".join(line.split()) for line
                                                                                in out.splitlines()}, out
        code, out, err = _run(["tokens", "list", "--token-file", str(token_file), "-o", "json"], capsys)
        assert code == 0 and token not in out and len(json.loads(out)) == 1
        code, out, err = _run(["tokens", "list", "--token-file", str(token_file)], capsys)
        header, row = out.splitlines()
        assert header.split()[:3] == ["ID", "PRINCIPAL", "DESCRIPTION"] and "alice" in row and token not in out
        assert "first token" in row and "ago" in row  # created, as an age
        # A member makes no join token: one line, exit status 1.
        code, out, err = _run(["join-tokens", "create", "--token-file", str(token_file)], capsys)
        assert code == 1 and err.startswith("trainyard: error: HTTP 403") and len(err.splitlines()) == 1
        # Without a token: one line saying where it is read from.
        code, out, err = _run(["whoami"], capsys)
        assert code == 1 and "TRAINYARD_TOKEN" in err

        monkeypatch.setenv("TRAINYARD_TOKEN", ADMIN_TOKEN)
        join = tmp_path / "gpu-7.join"
        code, out, err = _run(["join-tokens", "create", "--node", "gpu-7", "--output", str(join)], capsys)
        assert code == 0 and out == "" and join.read_text().startswith("tyj_")
        assert stat.S_IMODE(join.stat().st_mode) == 0o600
        code, out, err = _run(["join-tokens", "list", "--output", "json"], capsys)
        listed = json.loads(out)
        assert [t["node_name"] for t in listed] == ["gpu-7"] and join.read_text().strip() not in out
        code, out, err = _run(["join-tokens", "list"], capsys)
        assert "gpu-7" in out and ("in 59m" in out or "in 1h00m" in out), out  # expires in about an hour
        code, out, err = _run(["principals", "list"], capsys)
        assert out.split()[:3] == ["NAME", "TENANT", "ROLE"] and "alice" in out, out
        code, out, err = _run(["principals", "disable", "alice"], capsys)
        assert code == 0
        code, out, err = _run(["whoami", "--token-file", str(token_file)], capsys)
        assert code == 1 and "HTTP 401" in err
