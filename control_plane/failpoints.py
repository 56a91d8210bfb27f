"""Failpoints: named places in the control plane where a test can inject a pause or a crash.

Fault tests need to stop the control plane at an exact moment (say, between writing a checkpoint's
manifest and the commit update) rather than at a random one. ``TRAINYARD_FAILPOINTS`` names the
places and what to do there, e.g. ``checkpoint.before_commit=sleep(30)`` or
``checkpoint.before_commit=exit``; several are separated by ``;``. Unset (the default), ``hit`` is a
dictionary lookup and nothing else. The idea is that of etcd's gofail and TiKV's fail-rs.
"""

from __future__ import annotations

import os
import re
import time

import structlog

log = structlog.get_logger("trainyard.failpoints")

_ACTION = re.compile(r"^(sleep\((?P<seconds>\d+(\.\d+)?)\)|exit)$")
_active: dict[str, str] = {}


def configure(spec: str) -> None:
    """Parse ``name=action;name=action`` (actions: ``sleep(S)``, ``exit``); raises ValueError."""
    parsed: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        name, sep, action = part.partition("=")
        if not sep or not name.strip() or not _ACTION.match(action.strip()):
            raise ValueError(f"failpoint {part!r} is not NAME=sleep(SECONDS) or NAME=exit")
        parsed[name.strip()] = action.strip()
    _active.clear()
    _active.update(parsed)


def hit(name: str) -> None:
    """Run the action configured for ``name``, if any."""
    action = _active.get(name)
    if action is None:
        return
    log.warning("failpoint hit", failpoint=name, action=action)
    if action == "exit":
        os._exit(86)
    match = _ACTION.match(action)
    assert match is not None and match.group("seconds") is not None
    time.sleep(float(match.group("seconds")))
