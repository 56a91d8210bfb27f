"""Where a part's short TMPDIR is (node_agent/confinement/isolation.py, "A short TMPDIR per part"): a pure path
function, shared by the isolation that makes it and the limits that count it."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

SHORT_TMP_PARENT = Path("/tmp")


def short_tmp(worker: Path) -> Path:
    """The short TMPDIR of the part whose worker directory is ``worker`` (it may not exist)."""
    digest = hashlib.sha256(str(worker.absolute()).encode()).hexdigest()[:12]
    return SHORT_TMP_PARENT / f"trainyard-{os.geteuid()}" / digest
