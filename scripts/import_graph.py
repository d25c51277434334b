"""Check the import graph of tasks/ and flows/: no circle, no upward import, each folder of tasks/ importing
only what its __init__.py allows, a backend's package imported from within it alone, mlflow imported by
tasks/registry/ alone, schema within its size.

A circle (the schema calling preflight, which imports the schema) makes every module on it load,
test and change together; `tasks` importing `flows` puts the orchestration under the work it
orchestrates; a stage importing judging, or runtime importing anything above it, hides which part
depends on which. The graph is read from the source (AST), with imports inside functions counted
(they are circles all the same, only deferred) and those under `if TYPE_CHECKING:` counted too (a type
a module names is a dependency: a circle of them is a circle in the design, only unenforced at run time).
tests/test_import_graph.py runs this.

Usage: python scripts/import_graph.py [ROOT]   (default: this repository; exit 1 on a problem)
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

PACKAGES = ("tasks", "flows")
UPWARD = (("tasks", "flows"),)  # (importer, imported): a module of the first may not import the second
ONLY_FROM = {"mlflow": "tasks.registry"}  # a library only this package may import: the rest goes through it
# What each folder (or shared module) of tasks/ may import of tasks/ beyond itself; each __init__.py says why.
# A module outside them (tasks/graph.py, flows/) may import any of them.
_RECORDS = ("tasks.outcome", "tasks.metrics")  # what every folder reads of a candidate's result
MAY_IMPORT = {
    "tasks.runtime": (),
    "tasks.measure": ("tasks.runtime",),
    "tasks.config": ("tasks.runtime", "tasks.measure", "tasks.backends", "tasks.metrics"),
    "tasks.backends": ("tasks.runtime", "tasks.measure", "tasks.config"),
    "tasks.stages": ("tasks.runtime", "tasks.measure", "tasks.config", "tasks.backends", "tasks.registry", *_RECORDS),
    "tasks.registry": ("tasks.runtime", "tasks.measure", "tasks.config", "tasks.stages", *_RECORDS),
    "tasks.judge": ("tasks.runtime", "tasks.measure", "tasks.config", "tasks.backends", "tasks.stages",
                    "tasks.registry", *_RECORDS),
    "tasks.outcome": ("tasks.runtime", "tasks.config", "tasks.metrics"),
    "tasks.metrics": ("tasks.runtime",),
}
TOP_LEVEL_MODULES = 10  # at most this many modules directly in tasks/: the rest belongs in a folder
BUDGETS = {"tasks/config/spec.py": 500, "tasks/config/schema.py": 500,  # lines
           "tasks/registry/tracking.py": 100,  # re-exports only: the work is in tasks/registry/
           **{f"tasks/registry/{name}.py": 500 for name in ("__init__", "client", "runs", "versions", "uploads",
                                                           "card", "candidates", "webhooks")}}


def modules(root: Path) -> dict[str, Path]:
    """Every module of PACKAGES under root, by dotted name (a package by its own name)."""
    found = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _import_nodes(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement in `tree`, at any depth, TYPE_CHECKING blocks included."""
    return (node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom)))


def _imports(tree: ast.AST, name: str, is_package: bool, known: dict[str, Path]) -> set[str]:
    """The modules of `known` that module `name` imports."""
    found: set[str] = set()
    package = name if is_package else name.rpartition(".")[0]

    def resolve(module: str) -> str | None:
        while module and module not in known:
            module = module.rpartition(".")[0]
        return module or None

    for node in _import_nodes(tree):
        if isinstance(node, ast.Import):
            found.update(m for alias in node.names if (m := resolve(alias.name)))
            continue
        base = node.module or ""
        if node.level:
            anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join([*anchor, base] if base else anchor)
        for alias in node.names:
            target = resolve(f"{base}.{alias.name}") if f"{base}.{alias.name}" in known else resolve(base)
            if target:
                found.add(target)
    found.discard(name)
    return found


def libraries(tree: ast.AST) -> set[str]:
    """The top-level names of the absolute imports in `tree`."""
    found: set[str] = set()
    for node in _import_nodes(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif not node.level and node.module:
            found.add(node.module.split(".")[0])
    return found


def graph(root: Path) -> dict[str, set[str]]:
    known = modules(root)
    return {name: _imports(ast.parse(path.read_text(encoding="utf-8"), str(path)), name,
                           path.name == "__init__.py", known)
            for name, path in known.items()}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(edges) + 100))
    for v in sorted(edges):
        if v not in index:
            connect(v)
    return sorted(found)


def _within(name: str, place: str) -> bool:
    return name == place or name.startswith(place + ".")


def _rule_of(name: str) -> str | None:
    """The folder or shared module of MAY_IMPORT that holds module `name` (the innermost), or None."""
    places = [place for place in MAY_IMPORT if _within(name, place)]
    return max(places, key=len) if places else None


def folder_problems(edges: dict[str, set[str]]) -> list[str]:
    """Every import of a module of tasks/ that its folder's rule (MAY_IMPORT) does not allow."""
    found = []
    for name, targets in sorted(edges.items()):
        place = _rule_of(name)
        if place is None:
            continue
        allowed = (place, *MAY_IMPORT[place])
        found += [f"{name} imports {target}: {place.replace('.', '/')} may import only "
                  f"{', '.join(a.replace('.', '/') for a in MAY_IMPORT[place]) or 'itself'} of tasks/"
                  for target in sorted(targets) if target.split(".")[0] == "tasks"
                  and not any(_within(target, a) for a in allowed)]
    return found


def backend_package_problems(edges: dict[str, set[str]], root: Path) -> list[str]:
    """Every import of a backend's own package (tasks/backends/<name>/) from outside it: the rest of smelter
    reaches a backend through what it declares (tasks/backends/base.py, table.py), so a plugin's backend can do
    all that a built-in one does."""
    packages = {f"tasks.backends.{p.parent.name}" for p in (root / "tasks" / "backends").glob("*/__init__.py")}
    return [f"{name} imports {target}: a backend's package is imported by itself alone; the rest of smelter asks "
            "the backend through tasks/backends/base.py (TargetSpec, Backend)"
            for name, targets in sorted(edges.items()) for target in sorted(targets)
            for package in sorted(packages) if _within(target, package) and not _within(name, package)]


def problems(root: Path) -> list[str]:
    """Every rule the tree breaks, one sentence each."""
    edges = graph(root)
    found = [f"import circle: {' -> '.join(c)} (each imports another of them, directly or through the others)"
             for c in circles(edges)]
    for importer, imported in UPWARD:
        found += [f"{name} imports {target}: {importer}/ must not import {imported}/"
                  for name, targets in sorted(edges.items()) if name.split(".")[0] == importer
                  for target in sorted(targets) if target.split(".")[0] == imported]
    found += folder_problems(edges) + backend_package_problems(edges, root)
    top = sorted(p.name for p in (root / "tasks").glob("*.py") if p.name != "__init__.py")
    if len(top) > TOP_LEVEL_MODULES:
        found.append(f"tasks/ holds {len(top)} modules at its top level, over {TOP_LEVEL_MODULES}: put each in the "
                     f"folder of its role ({', '.join(top)})")
    for name, path in sorted(modules(root).items()):
        used = libraries(ast.parse(path.read_text(encoding="utf-8"), str(path)))
        found += [f"{name} imports {library}: only {owner} may (the rest goes through it)"
                  for library, owner in ONLY_FROM.items()
                  if library in used and name != owner and not name.startswith(owner + ".")]
    for path, limit in BUDGETS.items():
        if (root / path).is_file() and (lines := len((root / path).read_text(encoding="utf-8").splitlines())) > limit:
            found.append(f"{path} has {lines} lines, over its budget of {limit}: split it by concern")
    return found


def main(argv: list[str]) -> int:
    root = Path(argv[0]) if argv else Path(__file__).resolve().parents[1]
    found = problems(root)
    for line in found:
        print(line)
    if not found:
        edges = graph(root)
        print(f"ok: {len(edges)} modules, {sum(map(len, edges.values()))} imports, no circle")
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
