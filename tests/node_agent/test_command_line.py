"""One agent command line: ``trainyard agent`` and ``python -m node_agent`` are one table of options
(node_agent/options.py), so neither has an option the other lacks, and the same arguments make the
same agent."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from node_agent import options
from node_agent.config import AgentConfig

pytestmark = pytest.mark.usefixtures("keep_logging")

def _help_options(*command: str) -> set[str]:
    """The long options a command's --help lists (the first column of each option line, which argparse
    indents by two spaces, and its wrapped help text by more)."""
    out = subprocess.run([sys.executable, *command, "--help"], capture_output=True, text=True, timeout=60,
                         check=True).stdout
    found: set[str] = set()
    for line in out.splitlines():
        column = re.split(r"\s{2,}", line.strip())[0]
        if line.startswith("  -"):
            found |= {part.split()[0] for part in column.split(", ") if part.startswith("--")}
    return found


def test_both_command_lines_offer_the_same_options() -> None:
    table = {name for action in options.build_parser()._actions for name in action.option_strings
             if name.startswith("--")}
    cli = _help_options("-m", "trainyard", "agent")
    module = _help_options("-m", "node_agent")
    assert cli == module == table
    # What either of them lacked before they became one.
    assert {"--keep-workers-on-exit", "--stop-grace", "--pip-constraint", "--code-max-gb", "--log-level",
            "--cgroups", "--no-cgroups", "--part-limits", "--no-part-limits"} <= table


ARGS = ["--control-plane", "http://127.0.0.1:1", "--name", "n1", "--address", "127.0.0.2", "--virtual-gpus", "2",
        "--label", "rack = r1", "--label", "zone=z", "--worker-env", "HF_HOME", "--no-cgroups", "--standbys", "2",
        "--stop-grace", "1.5", "--handover-timeout", "9", "--keep-workers-on-exit", "--env-cache-max-count", "3",
        "--code-max-entries", "77", "--outbox-max-items", "500", "--outbox-max-mb", "2", "--memory-tier-mb", "16",
        "--memory-plain-http", "--part-memory-limit", "1G", "--part-pids-max", "99", "--no-part-limits"]


def _captured(monkeypatch: pytest.MonkeyPatch, run: Any) -> AgentConfig:
    seen: list[AgentConfig] = []
    import node_agent.agent

    monkeypatch.setattr(node_agent.agent, "run_agent", seen.append)
    with pytest.raises(SystemExit) as done:
        run()
    assert done.value.code in (0, None)
    assert len(seen) == 1
    return seen[0]


def test_the_same_arguments_make_the_same_agent(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    token = tmp_path / "join-token"
    token.write_text("t\n")
    argv = [*ARGS, "--join-token-file", str(token), "--work-dir", str(tmp_path / "agent")]
    from trainyard.cli.main import main as trainyard_main

    by_cli = _captured(monkeypatch, lambda: trainyard_main(["agent", *argv]))
    by_module = _captured(monkeypatch, lambda: sys.exit(options.main(argv, prog="python -m node_agent")))
    assert by_cli == by_module
    assert by_cli.labels == {"rack": "r1", "zone": "z"} and not by_cli.cgroups and by_cli.keep_workers_on_exit
    assert (by_cli.stop_grace_s, by_cli.outbox_max_bytes, by_cli.memory_tier_mb) == (1.5, 2 * 2**20, 16)
    assert not by_cli.limits.enabled and by_cli.limits.pids == 99


def test_defaults_and_variables(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TRAINYARD_JOIN_TOKEN", "t")
    monkeypatch.setenv("TRAINYARD_AGENT_MEMORY_TIER_MB", "32")
    monkeypatch.chdir(tmp_path)
    config = options.parse_args(["--control-plane", "http://x:1", "--name", "gpu-7", "--address", "10.0.0.7"])
    assert config.work_dir == tmp_path / ".trainyard" / "agent-gpu-7"
    assert config.memory_tier_mb == 32 and config.cgroups and config.limits.enabled
    monkeypatch.delenv("TRAINYARD_AGENT_MEMORY_TIER_MB")
    assert options.parse_args(["--control-plane", "http://x:1", "--name", "n", "--address", "a"]).memory_tier_mb \
        == AgentConfig.memory_tier_mb


@pytest.mark.parametrize("argv, says", [
    (["--control-plane", "ftp://x", "--name", "n", "--address", "a"], "http(s) URL"),
    (["--control-plane", "http://x", "--name", "n", "--address", "a", "--label", "nope"], "key=value"),
    # Never an abbreviation of --join-token-file: a token must not be an argument.
    (["--control-plane", "http://x", "--name", "n", "--address", "a", "--join-token", "s"], "--join-token"),
    (["--control-plane", "http://x", "--name", "n", "--address", "a", "--standbys", "65"], "0..64"),
    (["--control-plane", "http://x", "--name", "n", "--address", "a", "--memory-port", "-1"], "0..65535"),
])
def test_bad_input_is_one_line_and_status_2(argv: list[str], says: str, capsys: pytest.CaptureFixture[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINYARD_JOIN_TOKEN", "t")
    with pytest.raises(SystemExit) as done:
        options.parse_args(argv)
    assert done.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("trainyard agent: error:") and says in err[0], err
