"""The layering rules of tasks/ and flows/, read from the source: no import circle, nothing in tasks/
importing flows/, the schema within its size. The checker is shown to catch each rule on a tree that
breaks it, so a pass on the repository means something."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import import_graph  # noqa: E402


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_the_repository_keeps_its_layers() -> None:
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "import_graph.py")], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("ok: ")


def test_a_circle_through_a_deferred_import_is_found_and_type_checking_imports_are_not(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "tasks/__init__.py": "",
        "tasks/schema.py": "def check():\n    from tasks import checks\n    return checks\n",
        "tasks/checks.py": "from tasks.schema import check\n",
        "tasks/typed.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from tasks.uses_typed import X\n",
        "tasks/uses_typed.py": "from tasks.typed import TYPE_CHECKING\n",
        "flows/__init__.py": "",
    })
    assert import_graph.problems(root) == [
        "import circle: tasks.checks -> tasks.schema (each imports another of them, directly or through the others)"]


def test_tasks_importing_flows_and_an_oversized_schema_are_refused(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "tasks/__init__.py": "",
        "tasks/spec.py": "import flows.cli\n" + "X = 1\n" * 500,
        "tasks/stage.py": "from ..flows import cli\n",
        "flows/__init__.py": "",
        "flows/cli.py": "from tasks import spec\n",
    })
    found = import_graph.problems(root)
    assert "tasks.spec imports flows.cli: tasks/ must not import flows/" in found
    assert "tasks.stage imports flows.cli: tasks/ must not import flows/" in found
    assert "tasks/spec.py has 501 lines, over its budget of 500: split it by concern" in found
    assert any(p.startswith("import circle: flows.cli -> tasks.spec") for p in found)


def test_mlflow_imported_outside_the_registry_package_is_refused(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "tasks/__init__.py": "",
        "tasks/registry/__init__.py": "import mlflow\n",
        "tasks/registry/runs.py": "from mlflow.tracking import MlflowClient\n",
        "tasks/promote.py": "def f():\n    import mlflow.pyfunc\n",
        "tasks/typed.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import mlflow\n",
        "flows/__init__.py": "",
        "flows/cli.py": "from mlflow import MlflowClient\n",
    })
    assert import_graph.problems(root) == [
        "flows.cli imports mlflow: only tasks.registry may (the rest goes through it)",
        "tasks.promote imports mlflow: only tasks.registry may (the rest goes through it)"]
