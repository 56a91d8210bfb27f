"""A job's requirements: a pip requirements file, shipped as text with the job and installed by each
agent into a cached virtualenv (node_agent/part/envs.py). Standard library only.

Checked the same way at submit (422) and by the agent (a launch error): the text must stand alone
(no ``-r``/``-c`` naming files on the user's machine) and install from wheels only (no ``-e``, no
``--no-binary``/``--only-binary`` overriding the agent's ``--only-binary :all:``): installing a
wheel runs none of the package's code, so a job cannot run code as the agent's user while its
environment is built. Index options (``--index-url``, ``--find-links``, ``--no-index``...) are fine.

Every other line must be a package by name (PEP 508: a name, extras, version specifiers, a marker):
``--only-binary :all:`` does not apply to a direct reference (``name @ https://.../x.tar.gz``,
``name @ file:///...``), a bare URL or a path to an archive or a directory, and pip builds those
from source, running the package's own code (issue 23 review, finding 1).
"""

from __future__ import annotations

import re
from typing import Final

MAX_REQUIREMENTS_CHARS: Final = 64 * 1024
"""The most text a job's requirements may have."""

_REFUSED_LONG: Final = ("--requirement", "--constraint", "--editable", "--no-binary", "--only-binary")
_OPTION = re.compile(r"^(--[^=\s]+|-[A-Za-z])")
_BY_NAME = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?\s*(?:\[[A-Za-z0-9._,\s-]*\])?"
                      r"\s*[()<>=!~*.,A-Za-z0-9+\s-]*$")
"""A requirement by name, up to its marker: no ``@``, ``/``, ``:`` or ``\\`` (a URL or a path)."""
_ARCHIVES: Final = (".zip", ".whl", ".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tbz", ".tar.xz", ".txz", ".tlz",
                    ".tar.lz", ".tar.lzma")
"""pip takes a line whose name ends so as a path to that archive (relative to its cwd)."""


def _refused(line: str) -> bool:
    option = _OPTION.match(line)
    if option is None:
        return False
    name = option.group(1)
    if not name.startswith("--"):
        return name in ("-r", "-c", "-e")
    # pip's option parser takes any unambiguous prefix of a long option (--no-bin).
    return any(long.startswith(name) for long in _REFUSED_LONG)


def _not_by_name(line: str) -> bool:
    """A line pip would install from a URL or a path, not by name from an index (see above)."""
    if line.startswith("-"):
        return False  # an option; refused or not by _refused
    # The requirement proper ends at its marker, or at per-requirement options (--hash=...).
    head = re.split(r"\s;|;|\s--", line, maxsplit=1)[0].strip()
    name = re.split(r"[\s\[(<>=!~]", head, maxsplit=1)[0]
    return _BY_NAME.match(head) is None or name.lower().endswith(_ARCHIVES)


def requirement_lines(text: str) -> list[str]:
    """The lines that say something: comments, blank lines and surrounding spaces dropped, line
    continuations joined. Two texts with the same lines install the same environment."""
    lines: list[str] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.split(" #", 1)[0].strip() if not raw.lstrip().startswith("#") else ""
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = (pending + line).strip()
        pending = ""
        if line:
            lines.append(" ".join(line.split()))
    if pending.strip():
        lines.append(" ".join(pending.split()))
    return lines


def requirements_problem(text: str) -> str | None:
    """Why a job's requirements text is refused, or None."""
    if len(text) > MAX_REQUIREMENTS_CHARS:
        return f"requirements are {len(text)} characters, over {MAX_REQUIREMENTS_CHARS}"
    if any(c in text for c in "\0\r") or any(ord(c) < 32 and c not in "\n\t" for c in text):
        return "requirements must be plain text lines (no NUL or control characters)"
    lines = requirement_lines(text)
    if not lines:
        return "requirements name no package"
    for line in lines:
        if _refused(line):
            return (f"requirements line {line[:80]!r} is refused: the text must stand alone (no -r/-c) and "
                    "install from wheels only (no -e, --no-binary or --only-binary)")
        if _not_by_name(line):
            return (f"requirements line {line[:80]!r} is refused: a package is named (name, extras, versions, "
                    "marker), never a URL, a path or 'name @ url' (pip would build those from source)")
    return None
