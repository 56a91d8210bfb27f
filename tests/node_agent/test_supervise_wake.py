"""node_agent/loops/wake.py: a watched process's exit and a file renamed into a watched
directory wake supervision; nothing else does, and a link is never followed."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from node_agent.loops.wake import SuperviseWakeups


@pytest.fixture
def woken() -> Iterator[tuple[SuperviseWakeups, threading.Event]]:
    event = threading.Event()
    wakeups = SuperviseWakeups(event.set)
    try:
        yield wakeups, event
    finally:
        wakeups.close()


def test_a_watched_process_exit_wakes(woken: tuple[SuperviseWakeups, threading.Event]) -> None:
    wakeups, event = woken
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        wakeups.watch_pids([proc.pid])
        wakeups.watch_pids([proc.pid])  # watched once
        assert wakeups.watched_pids == {proc.pid}
        assert not event.wait(0.2)  # alive: no wake
        assert proc.stdin is not None
        proc.stdin.close()  # it exits
        assert event.wait(10)
        proc.wait(10)
        assert wakeups.watched_pids == set()  # forgotten once it fired
    finally:
        proc.kill()
        proc.wait()


def test_a_rank_file_renamed_into_a_watched_directory_wakes(
        woken: tuple[SuperviseWakeups, threading.Event], tmp_path: Path) -> None:
    wakeups, event = woken
    status = tmp_path / "status"
    status.mkdir()
    wakeups.watch_dir(status)
    (status / "rank-0.json.tmp").write_text("{}")
    assert not event.wait(0.2)  # a write alone is not a new rank file
    os.replace(status / "rank-0.json.tmp", status / "rank-0.json")
    assert event.wait(10)


def test_a_link_in_place_of_the_directory_is_not_watched(
        woken: tuple[SuperviseWakeups, threading.Event], tmp_path: Path) -> None:
    wakeups, event = woken
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "status").symlink_to(elsewhere)
    wakeups.watch_dir(tmp_path / "status")
    (elsewhere / "x.tmp").write_text("{}")
    os.replace(elsewhere / "x.tmp", elsewhere / "x")
    assert not event.wait(0.3)


def test_at_most_max_pids_are_held_first_come_first(
        woken: tuple[SuperviseWakeups, threading.Event], monkeypatch: pytest.MonkeyPatch) -> None:
    wakeups, _ = woken
    monkeypatch.setattr("node_agent.loops.wake.MAX_PIDS", 2)
    mine = [os.getpid(), os.getppid(), 1]
    wakeups.watch_pids(mine)
    assert wakeups.watched_pids == set(mine[:2])
