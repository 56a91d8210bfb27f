"""Jobs' requirements on a node (node_agent/part/envs.py): the venv's key says what it is built from and
nothing else; eviction is least recently used, within a count and a size, never of a venv in use;
the real cache (real pip, a local wheel, no network) builds a key once however many attempts ask at
once, builds another for changed requirements, leaves the tree read-only to other users, sees the
node's own torch, and says in one line why an install failed."""

from __future__ import annotations

import stat
import subprocess
import sys
import threading
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from node_agent.confinement.isolation import Confinement
from node_agent.part.attempt import Part, attempt_paths
from node_agent.part.envs import MARKER, CachedEnv, EnvBuildFailed, EnvCache, Interpreter, env_key, evictions
from tests.helpers import in_parallel, make_wheel, wait_for
from tests.node_agent.helpers import Launcher, make_spec
from trainyard.protocol.agent import NodeAttemptState
from trainyard.protocol.requirements import requirement_lines, requirements_problem

NODE = Interpreter(path="/usr/bin/python3", version="3.11.2", prefix="/usr", site=("/usr/lib/python3/dist-packages",),
                   pins=(("torch", "2.13.0"),), lib="python3.11")


def _key(text: str, interpreter: Interpreter = NODE, constraints: str = "torch==2.13.0\n") -> str:
    return env_key(requirement_lines(text), interpreter, constraints)


def test_the_key_is_the_content_that_decides_the_venv() -> None:
    base = _key("numpy==2.0\nrich\n")
    assert _key("# pinned\nnumpy==2.0   # fast\n\n  rich\n") == base  # comments and spacing change nothing
    assert _key("numpy==2.1\nrich\n") != base
    assert _key("numpy==2.0\nrich\n", NODE.__class__(**{**NODE.__dict__, "path": "/opt/py/bin/python"})) != base
    assert _key("numpy==2.0\nrich\n", NODE.__class__(**{**NODE.__dict__, "version": "3.12.1"})) != base
    assert _key("numpy==2.0\nrich\n", constraints="torch==2.13.0\nnumpy<2\n") != base


def test_requirements_that_read_files_or_build_from_source_are_refused() -> None:
    assert requirements_problem("--no-index\n-f /srv/wheels\nnumpy==2.0\n") is None
    for text in ("-r base.txt", "-rbase.txt", "--requirement=base.txt", "-c c.txt", "-e .", "--editable=git+x",
                 "--no-binary :all:", "--no-bin :all:", "--only-binary=none",
                 # pip builds these from source, --only-binary :all: or not (issue 23 review, finding 1)
                 "evilpkg @ file:///tmp/evilpkg-1.0.tar.gz", "evilpkg@https://attacker/evilpkg-1.0.tar.gz",
                 "evilpkg[x] @ https://a/e.whl", "https://attacker/evilpkg-1.0.tar.gz", "file:///srv/e.tar.gz",
                 "./evilpkg", "/srv/evilpkg", "evilpkg-1.0.tar.gz", "evilpkg-1.0-py3-none-any.whl", "e.zip",
                 "git+https://attacker/e", "evilpkg ${HOME}"):
        assert requirements_problem(f"numpy\n{text}\n") is not None, text
    assert "no package" in (requirements_problem("# only a comment\n") or "")
    for text in ("numpy==2.0", "torch>=2; python_version<'3.12'", "foo[bar,baz]>=1.0,<2", "Foo.Bar_baz~=1.2.*",
                 "x (>=1.0)", "tinypkg==1.0 --hash=sha256:abc", "--index-url https://u:t@host/simple", "pkg===1.0+l"):
        assert requirements_problem(f"{text}\n") is None, text


def _env(key: str, used: float, size: int = 10) -> CachedEnv:
    return CachedEnv(key=key, last_used=used, size_bytes=size)


def test_eviction_is_least_recently_used_and_never_of_a_venv_in_use() -> None:
    envs = [_env("a", 1), _env("b", 2), _env("c", 3), _env("d", 4)]
    assert evictions(envs, max_count=2, max_bytes=10**9, in_use=set()) == ["a", "b"]
    assert evictions(envs, max_count=2, max_bytes=10**9, in_use={"a"}) == ["b", "c"]
    assert evictions(envs, max_count=10, max_bytes=25, in_use=set()) == ["a", "b"]  # 40 bytes -> 20
    assert evictions(envs, max_count=1, max_bytes=10**9, in_use={"a", "b", "c", "d"}) == []  # stays over


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 100), st.booleans()), max_size=12),
       st.integers(1, 6), st.integers(0, 400))
def test_eviction_keeps_what_is_in_use_and_the_most_recent(items, max_count, max_bytes) -> None:
    envs = [_env(f"k{i}", used, size) for i, (used, size, _) in enumerate(items)]
    in_use = {f"k{i}" for i, (_, _, held) in enumerate(items) if held}
    chosen = evictions(envs, max_count=max_count, max_bytes=max_bytes, in_use=in_use)
    assert not set(chosen) & in_use and len(chosen) == len(set(chosen))
    kept = [e for e in envs if e.key not in chosen]
    if len(kept) > max_count or sum(e.size_bytes for e in kept) > max_bytes:
        assert {e.key for e in kept} <= in_use  # over the limits only when nothing else may go
    removable = [e for e in envs if e.key not in in_use]
    # Nothing more recent is removed while something older that could be is kept.
    for gone in (e for e in envs if e.key in chosen):
        assert all((k.last_used, k.key) > (gone.last_used, gone.key) for k in removable if k.key not in chosen)


class CountingCache(EnvCache):
    """The real cache, counting its builds (to show that concurrent asks build once)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.builds = 0

    def _build(self, *args, **kwargs) -> None:
        self.builds += 1
        super()._build(*args, **kwargs)


@pytest.fixture
def wheels(tmp_path: Path) -> Path:
    make_wheel(tmp_path / "wheels", "tinypkg", "1.0", "MARK = 'one'\n")
    make_wheel(tmp_path / "wheels", "tinypkg", "2.0", "MARK = 'two'\n")
    return tmp_path / "wheels"


def _run(python: str, code: str) -> str:
    return subprocess.run([python, "-c", code], capture_output=True, text=True, check=True, timeout=60).stdout.strip()


def test_a_venv_is_built_once_shared_read_only_and_sees_the_nodes_torch(tmp_path: Path, wheels: Path) -> None:
    cache = CountingCache(tmp_path / "envs", max_count=1)
    one = f"--no-index\n--find-links {wheels}\ntinypkg==1.0\n"
    (a_key, a_python), (b_key, b_python), (c_key, _) = in_parallel(
        cache.acquire, [(one, sys.executable)] * 3, timeout=120)
    assert a_key == b_key == c_key and a_python == b_python and cache.builds == 1
    assert _run(a_python, "import tinypkg, torch; print(tinypkg.MARK, torch.__version__)") == \
        f"one {metadata.version('torch')}"  # the node's own torch
    for path in (tmp_path / "envs" / a_key).rglob("*"):
        if not path.is_symlink():
            mode = path.lstat().st_mode
            assert not mode & (stat.S_IWGRP | stat.S_IWOTH) and mode & stat.S_IROTH, path

    # Changed requirements: another venv, while the first is in use (three holders) it is kept.
    two = f"--no-index\n--find-links {wheels}\ntinypkg==2.0\n"
    d_key, d_python = cache.acquire(two, sys.executable)
    assert d_key != a_key and cache.builds == 2 and _run(d_python, "import tinypkg; print(tinypkg.MARK)") == "two"
    assert {e.key for e in cache.cached()} == {a_key, d_key}  # over max_count=1: both in use
    for key in (a_key, a_key, a_key):
        cache.release(key)
    assert cache.acquire(two, sys.executable)[0] == d_key and cache.builds == 2  # reused, not rebuilt
    assert {e.key for e in cache.cached()} == {d_key}  # the unused one was evicted


def test_an_install_that_fails_says_why_in_one_line_and_leaves_nothing(tmp_path: Path, wheels: Path) -> None:
    cache = EnvCache(tmp_path / "envs")
    with pytest.raises(EnvBuildFailed) as failed:
        cache.acquire(f"--no-index\n--find-links {wheels}\ntinypkg==3.0\n", sys.executable)
    reason = str(failed.value)
    assert "\n" not in reason and "No matching distribution found for tinypkg==3.0" in reason, reason
    assert cache.cached() == [] and not [p for p in (tmp_path / "envs").iterdir() if p.name != ".locks"]


def test_a_build_that_died_is_built_again(tmp_path: Path, wheels: Path) -> None:
    cache = CountingCache(tmp_path / "envs")
    one = f"--no-index\n--find-links {wheels}\ntinypkg==1.0\n"
    key, python = cache.acquire(one, sys.executable)
    cache.release(key)
    (tmp_path / "envs" / key / MARKER).unlink()  # as if the agent had died before the marker
    assert cache.acquire(one, sys.executable) == (key, python) and cache.builds == 2


class GatedCache(EnvCache):
    """The real cache, whose builds wait for the test to let them go."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.asked, self.go = threading.Event(), threading.Event()

    def acquire(self, requirements: str, python: str, build_as: Confinement | None = None,
                cancelled: Callable[[], bool] | None = None) -> tuple[str, str]:
        self.asked.set()
        assert self.go.wait(60)
        return super().acquire(requirements, python, build_as, cancelled)


def test_a_part_stopped_while_its_venv_builds_never_starts(launcher: Launcher, tmp_path: Path, wheels: Path) -> None:
    """The build runs beside the part (launching, stoppable); stopped before its build began, the
    part is done at once, and no build starts for it later: nothing starts, no venv is held."""
    cache = GatedCache(tmp_path / "envs")
    spec = make_spec(nproc_per_node=1, gpu_indices=[0],
                     requirements=f"--no-index\n--find-links {wheels}\ntinypkg==1.0\n")
    node = launcher.node()
    run = Part.launch(spec, node, attempt_paths(tmp_path / "node", spec.attempt_id), stop_grace_s=2.0,
                            envs=cache)
    launcher.runs.append(run)
    assert cache.asked.wait(30) and run.alive and run.report(None, None).state == NodeAttemptState.launching
    run.request_stop("cancelled")
    assert run.finished and run.report(None, None).state == NodeAttemptState.stopped
    cache.go.set()
    wait_for(lambda: not run.preparing, 30, what="the build thread to end")
    assert run.pid is None and run.env_key is None and not cache.in_use() and cache.cached() == []
