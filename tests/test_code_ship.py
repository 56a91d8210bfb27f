"""Packing a job's workdir (trainyard/cli/code_ship.py): .gitignore files apply below their folder,
.git and caches stay out, and the archive is reproducible (the same files, the same sha256)."""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
from pathlib import Path

import pytest

from trainyard.cli.api_client import ApiError
from trainyard.cli.code_ship import files_of, pack


def _tree(root: Path) -> None:
    files = {
        "train.py": "print('hi')\n", "lib/model.py": "X = 1\n", "lib/data/big.bin": "x" * 100,
        "lib/.gitignore": "data/\n*.tmp\n", "lib/scratch.tmp": "t", "notes.tmp": "kept: the rule is lib's only",
        ".gitignore": "*.log\n!keep.log\n", "run.log": "no", "keep.log": "yes", ".git/HEAD": "ref",
        "__pycache__/x.pyc": "", "lib/y.pyc": "",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    os.chmod(root / "train.py", 0o755)


def test_gitignore_rules_apply_below_their_folder(tmp_path: Path) -> None:
    _tree(tmp_path)
    assert [p.as_posix() for p in files_of(tmp_path)] == [
        ".gitignore", "keep.log", "lib/.gitignore", "lib/model.py", "notes.tmp", "train.py"]


def test_the_archive_is_reproducible_and_keeps_modes(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    for root in (a, b):
        root.mkdir()
        _tree(root)
    os.utime(b / "train.py", (1, 1))  # times do not count
    assert hashlib.sha256(pack(a)).digest() == hashlib.sha256(pack(b)).digest()
    with tarfile.open(fileobj=io.BytesIO(pack(a)), mode="r:gz") as tar:
        modes = {m.name: m.mode for m in tar.getmembers()}
    assert modes["train.py"] == 0o755 and modes["lib/model.py"] == 0o644
    (b / "lib" / "model.py").write_text("X = 2\n")
    assert pack(a) != pack(b)


def test_a_link_out_of_the_workdir_is_refused(tmp_path: Path) -> None:
    (tmp_path / "w").mkdir()
    (tmp_path / "secret").write_text("s")
    (tmp_path / "w" / "link").symlink_to(tmp_path / "secret")
    with pytest.raises(ApiError, match="links out of the workdir"):
        files_of(tmp_path / "w")


def test_a_job_files_requirements_file_becomes_its_requirements(tmp_path: Path) -> None:
    from trainyard.cli.jobs import load_spec

    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "requirements.txt").write_text("tinypkg==1.0\n")
    job = tmp_path / "job.yaml"
    job.write_text("name: j\nworkdir: code\nrequirements_file: code/requirements.txt\n")
    body, workdir = load_spec(job)
    assert body == {"name": "j", "requirements": "tinypkg==1.0\n"} and workdir == (tmp_path / "code").resolve()
    job.write_text("name: j\nrequirements_file: missing.txt\n")
    with pytest.raises(ApiError, match="cannot read requirements_file missing.txt"):
        load_spec(job)
    job.write_text("name: j\nrequirements_file: code/requirements.txt\nrequirements: other\n")
    with pytest.raises(ApiError, match="may not also set requirements"):
        load_spec(job)


def test_a_trainyardignore_applies_after_the_gitignore_of_its_folder(tmp_path: Path) -> None:
    """Issue 26 item 6: a workdir's .trainyardignore (gitignore syntax) leaves out what git keeps
    (data, checkpoints) and can ship what git ignores (a generated config)."""
    _tree(tmp_path)
    (tmp_path / ".trainyardignore").write_text("notes.tmp\n!run.log\n")
    (tmp_path / "lib" / ".trainyardignore").write_text("model.py\n")
    assert [p.as_posix() for p in files_of(tmp_path)] == [
        ".gitignore", ".trainyardignore", "keep.log", "lib/.gitignore", "lib/.trainyardignore", "run.log", "train.py"]
