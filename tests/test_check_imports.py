"""scripts/check_imports.py, run by `make lint`: import cycles and stale cycle-dodging imports."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("check_imports", ROOT / "scripts" / "check_imports.py")
assert _spec and _spec.loader
check_imports = importlib.util.module_from_spec(_spec)
sys.modules["check_imports"] = check_imports
_spec.loader.exec_module(check_imports)


def _package(tmp_path: Path, files: dict[str, str]) -> dict[str, Path]:
    modules = {}
    for name, text in files.items():
        path = tmp_path / (name.replace(".", "/") + ".py")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        modules[name] = path
    return modules


def test_the_tree_has_no_cycle_and_no_stale_deferred_import() -> None:
    assert check_imports.problems(check_imports._modules()) == []


def test_a_module_level_cycle_is_found_and_type_checking_imports_do_not_count(tmp_path: Path) -> None:
    modules = _package(tmp_path, {
        "lib.a": "from lib import b\n",
        "lib.b": "from lib.c import thing\n",
        "lib.c": "import lib.a\nthing = 1\n",
        "lib.d": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from lib import e\n",
        "lib.e": "from lib import d\n",
    })
    assert check_imports.problems(modules, ("lib",)) == [
        "import cycle through module-level imports: lib.a <-> lib.b <-> lib.c"]


def test_a_deferred_import_must_dodge_a_cycle_or_say_why(tmp_path: Path) -> None:
    modules = _package(tmp_path, {
        "lib.a": "from lib import b\n",
        "lib.b": "def f():\n    from lib import a  # closes a cycle: allowed\n",
        "lib.c": "def f():\n    from lib import a\n",
        "lib.d": "def f():\n    from lib import a  # deferred: heavy\n",
        "tool.x": "def f():\n    from lib import a\n",  # not a library: lazy on purpose
    })
    found = check_imports.problems(modules, ("lib",))
    assert len(found) == 1 and found[0].endswith(
        ":2: import of lib.a inside a function dodges no cycle: move it to the top, or say why with "
        "'# deferred: <reason>'") and "lib/c.py" in found[0], found
