"""The layering rules of tasks/ and flows/, read from the source: no import circle (TYPE_CHECKING imports
counted), nothing in tasks/ importing flows/, each folder of tasks/ importing only what its __init__.py
allows, a backend's package imported from within it alone, at most ten modules at the top of tasks/, the schema within its size. The checker is shown to catch
each rule on a tree that breaks it, so a pass on the repository means something."""

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


def test_a_circle_through_a_deferred_or_a_type_checking_import_is_found(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "tasks/__init__.py": "",
        "tasks/schema.py": "def check():\n    from tasks import checks\n    return checks\n",
        "tasks/checks.py": "from tasks.schema import check\n",
        "tasks/typed.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from tasks.uses_typed import X\n",
        "tasks/uses_typed.py": "from tasks.typed import TYPE_CHECKING\n",
        "flows/__init__.py": "",
    })
    assert import_graph.problems(root) == [
        "import circle: tasks.checks -> tasks.schema (each imports another of them, directly or through the others)",
        "import circle: tasks.typed -> tasks.uses_typed (each imports another of them, directly or through the others)"]


def test_each_folder_imports_only_what_its_rule_allows_type_checking_imports_included(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "tasks/runtime/__init__.py": "",
        "tasks/runtime/store.py": "from tasks.config import spec\n",
        "tasks/runtime/locks.py": "from tasks.runtime import store\n",
        "tasks/config/__init__.py": "",
        "tasks/config/spec.py": "from tasks.runtime.locks import lock\n",
        "tasks/measure/__init__.py": "",
        "tasks/measure/rounds.py": "def inputs():\n    from tasks.stages import inputs\n",
        "tasks/stages/__init__.py": "",
        "tasks/stages/inputs.py": "from tasks.config.spec import ModelSpec\n",
        "tasks/stages/benchmark.py": ("from typing import TYPE_CHECKING\nfrom tasks.outcome import Champion\n"
                                      "if TYPE_CHECKING:\n    from tasks.judge.gates import GateResult\n"),
        "tasks/judge/__init__.py": "",
        "tasks/judge/gates.py": "from tasks.stages import inputs\nfrom tasks.measure import rounds\n",
        "tasks/outcome.py": "from tasks.config.spec import Candidate\n",
        "tasks/graph.py": "from tasks.judge import gates\nfrom tasks.stages import benchmark\n",
        "flows/__init__.py": "",
        "flows/pipeline.py": "from tasks.judge import gates\nfrom tasks.runtime import store\n",
    })
    assert import_graph.problems(root) == [
        "import circle: tasks.config.spec -> tasks.runtime.locks -> tasks.runtime.store (each imports another of "
        "them, directly or through the others)",
        "tasks.measure.rounds imports tasks.stages.inputs: tasks/measure may import only tasks/runtime of tasks/",
        "tasks.runtime.store imports tasks.config.spec: tasks/runtime may import only itself of tasks/",
        "tasks.stages.benchmark imports tasks.judge.gates: tasks/stages may import only tasks/runtime, "
        "tasks/measure, tasks/config, tasks/backends, tasks/registry, tasks/outcome, tasks/metrics of tasks/"]


def test_a_backends_package_is_imported_from_within_it_alone(tmp_path: Path) -> None:
    """The core asks a backend through the interface; a backend's own modules are its business (a plugin's are
    out of reach anyway)."""
    root = _tree(tmp_path, {
        "tasks/backends/__init__.py": "",
        "tasks/backends/base.py": "",
        "tasks/backends/fast/__init__.py": "",
        "tasks/backends/fast/target.py": "from tasks.backends.base import TargetSpec\n",
        "tasks/backends/fast/rules.py": "from tasks.backends.fast import target\n",
        "tasks/backends/slow/__init__.py": "",
        "tasks/backends/slow/backend.py": "from tasks.backends.fast.rules import RULE\n",
        "tasks/config/__init__.py": "",
        "tasks/config/preflight.py": "def check():\n    from tasks.backends.fast import rules\n",
        "flows/__init__.py": "",
        "flows/pipeline.py": "from tasks.backends.base import Backend\nfrom tasks.backends.slow.backend import X\n",
    })
    assert import_graph.problems(root) == [
        f"{name} imports {target}: a backend's package is imported by itself alone; the rest of smelter asks the "
        "backend through tasks/backends/base.py (TargetSpec, Backend)"
        for name, target in (("flows.pipeline", "tasks.backends.slow.backend"),
                             ("tasks.backends.slow.backend", "tasks.backends.fast.rules"),
                             ("tasks.config.preflight", "tasks.backends.fast.rules"))]


def test_more_than_ten_modules_at_the_top_of_tasks_are_refused(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"flows/__init__.py": "", **{f"tasks/m{i:02}.py": "" for i in range(10)}})
    assert import_graph.problems(root) == []
    _tree(root, {"tasks/m10.py": ""})
    assert import_graph.problems(root) == [
        "tasks/ holds 11 modules at its top level, over 10: put each in the folder of its role "
        f"({', '.join(f'm{i:02}.py' for i in range(11))})"]


def test_tasks_importing_flows_and_an_oversized_schema_are_refused(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "tasks/__init__.py": "",
        "tasks/config/spec.py": "import flows.cli\n" + "X = 1\n" * 500,
        "tasks/stage.py": "from ..flows import cli\n",
        "flows/__init__.py": "",
        "flows/cli.py": "from tasks.config import spec\n",
    })
    found = import_graph.problems(root)
    assert "tasks.config.spec imports flows.cli: tasks/ must not import flows/" in found
    assert "tasks.stage imports flows.cli: tasks/ must not import flows/" in found
    assert "tasks/config/spec.py has 501 lines, over its budget of 500: split it by concern" in found
    assert any(p.startswith("import circle: flows.cli -> tasks.config.spec") for p in found)


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
        "tasks.promote imports mlflow: only tasks.registry may (the rest goes through it)",
        "tasks.typed imports mlflow: only tasks.registry may (the rest goes through it)"]
