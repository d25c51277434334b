"""One definition per constant: a bound or setting written in two modules drifts apart (tasks/measure/rounds.py stopped at
2000 rounds while the schema let min_rounds go to 10,000, so the rounds it claimed were never measured).

Read from the source with ast: module-level UPPER_CASE names assigned in tasks/ and flows/.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BOUNDS = REPO / "tasks" / "config" / "bounds.py"
# Names each module of a kind declares for itself, meaning the same thing of a different module: a stage's
# CODE (its modules, in its key), TOOLS (versioned in its key) and STAGE; the Triton KERNELS a module of ops
# launches; each graph family's PRODUCTS; or one word for two things that are not alike (MLflow's webhook
# headers and smelter's own, a file name per module, a poll interval per loop).
OWN_PER_MODULE = {"CODE", "TOOLS", "STAGE", "PREFIX", "FILE", "EVENT", "POLL_S", "KERNELS", "PRODUCTS",
                  "DELIVERY_ID_HEADER", "SIGNATURE_HEADER", "TIMESTAMP_HEADER"}


def module_constants(path: Path) -> dict[str, str]:
    """UPPER_CASE names a module assigns at its top level, each with its value's source. A name bound to another
    module's attribute (`X = other.X`) is a use, not a definition."""
    found = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        for target in targets:
            pairs = (zip(target.elts, value.elts) if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple)
                     else [(target, value)])
            for name, assigned in pairs:
                if (isinstance(name, ast.Name) and name.id.isupper() and len(name.id) > 1
                        and not isinstance(assigned, ast.Attribute)):
                    found[name.id] = ast.unparse(assigned)
    return found


def definitions(root: Path = REPO) -> dict[str, dict[str, str]]:
    """Every constant of tasks/ and flows/: name -> {module path: value}."""
    found: dict[str, dict[str, str]] = defaultdict(dict)
    for folder in ("tasks", "flows"):
        for path in sorted((root / folder).rglob("*.py")):
            for name, value in module_constants(path).items():
                found[name][str(path.relative_to(root))] = value
    return found


def test_every_bound_of_the_schema_is_defined_once() -> None:
    """measure, compare and the schema read a bound (MAX_ROUNDS, ...) from tasks/config/bounds.py, never a copy."""
    everything = definitions()
    copies = {name: {m: v for m, v in everything[name].items() if m != str(BOUNDS.relative_to(REPO))}
              for name in module_constants(BOUNDS)}
    assert not {name: where for name, where in copies.items() if where}, copies


def test_no_constant_is_defined_twice_with_different_values() -> None:
    clashes = {name: where for name, where in definitions().items()
               if len(set(where.values())) > 1 and name not in OWN_PER_MODULE}
    assert not clashes, clashes


def test_the_check_finds_a_bound_written_twice(tmp_path: Path) -> None:
    """The checks above read what they should: a tree with a bound copied under another value is caught."""
    (tmp_path / "tasks").mkdir()
    (tmp_path / "flows").mkdir()
    (tmp_path / "tasks" / "measure").mkdir()
    (tmp_path / "tasks" / "bounds.py").write_text("MAX_ROUNDS = 10_000\nNAME: str = 'x'\n")
    (tmp_path / "tasks" / "measure" / "rounds.py").write_text("import bounds\nMAX_ROUNDS = 2000\nKEPT = bounds.NAME\n")
    assert definitions(tmp_path) == {"MAX_ROUNDS": {"tasks/bounds.py": "10000", "tasks/measure/rounds.py": "2000"},
                                     "NAME": {"tasks/bounds.py": "'x'"}}
