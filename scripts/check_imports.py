"""Import hygiene that import-linter's contracts do not cover (`make lint`):

1. no import cycle among first-party modules through module-level imports (``if TYPE_CHECKING:``
   imports do not count: they never run);
2. no stale cycle dodge in the libraries (the control plane, the agent, the worker runtime, the wire
   contract and storage): an import of a first-party module inside a function is allowed only when
   moving it to the top of its module would close a cycle, or when it says why with a trailing
   ``# deferred: <reason>`` comment (a heavy import kept off a path that does not need it). The
   tools (the CLI, the dev cluster, the embedded servers, bench/) import lazily on purpose, so that
   ``trainyard --help`` and each command load only what they use.

Prints each cycle and each stale deferred import; exits 1 if there is any.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("control_plane", "node_agent", "worker_runtime", "trainyard", "bench")
LIBRARIES = ("control_plane", "node_agent", "worker_runtime", "trainyard.protocol", "trainyard.storage")


@dataclass(frozen=True)
class Import:
    source: str
    target: str
    line: int
    top_level: bool
    reason: str | None


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The first-party module an imported name lives in (``a.b.c`` may be a name in module ``a.b``)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk(node: ast.AST, top: bool) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            continue  # type-only imports never run
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, top
        nested = top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        yield from _walk(child, nested)


def imports(modules: dict[str, Path]) -> list[Import]:
    found: list[Import] = []
    for module, path in modules.items():
        text = path.read_text()
        lines = text.splitlines()
        is_package = path.name == "__init__.py"
        for node, top in _walk(ast.parse(text, str(path)), True):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = module.split(".") if is_package else module.split(".")[:-1]
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join([*anchor, *([base] if base else [])])
                names = [f"{base}.{alias.name}" for alias in node.names]
            comment = lines[node.lineno - 1].partition("# deferred:")[2].strip() or None
            for name in names:
                target = _resolve(name, modules)
                if target is not None and target != module and not module.startswith(target + "."):
                    found.append(Import(module, target, node.lineno, top, comment))
    return found


def _graph(edges: list[Import]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for e in edges:
        graph.setdefault(e.source, set()).add(e.target)
    return graph


def _reaches(graph: dict[str, set[str]], start: str, goal: str) -> bool:
    seen, todo = {start}, [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt == goal:
                return True
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return False


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def problems(modules: dict[str, Path], libraries: tuple[str, ...] = LIBRARIES) -> list[str]:
    """Each import cycle and each stale deferred import among ``modules`` (name -> file)."""
    edges = imports(modules)
    top = _graph([e for e in edges if e.top_level])
    found = [f"import cycle through module-level imports: {' <-> '.join(c)}" for c in cycles(top)]
    seen: set[tuple[str, int, str]] = set()
    for e in edges:
        library = any(e.source == p or e.source.startswith(p + ".") for p in libraries)
        if e.top_level or e.reason or not library or (e.source, e.line, e.target) in seen:
            continue
        seen.add((e.source, e.line, e.target))
        if not _reaches(top, e.target, e.source):
            where = modules[e.source].relative_to(ROOT) if modules[e.source].is_relative_to(ROOT) else modules[e.source]
            found.append(f"{where}:{e.line}: import of {e.target} inside a function dodges no cycle: move it "
                         "to the top, or say why with '# deferred: <reason>'")
    return found


def main() -> int:
    modules = _modules()
    found = problems(modules)
    for line in found:
        print(line)
    if not found:
        print(f"imports: {len(modules)} modules, no cycle, no stale deferred import")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
