"""Who may hold a whole PipelineSpec, read from the source: the flows that load the file and hand each step its
settings, the graph that lays the steps out, the parent run that logs every setting, and the precision stage's
own settings. Every other function of tasks/ and flows/ takes only what it reads (tasks/config/settings.py,
tasks/config/stage_settings.py), so a key or a decision cannot start depending on another key of the file
unseen: a new parameter or field typed PipelineSpec fails here until it is narrowed, or listed with why."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

HOLDERS = {
    "flows/nightly.py:_failed_pipeline": "a pipeline that crashed before its stages: each selected candidate fails",
    "flows/pipeline.py:build_candidate": "hands the graph the spec to lay out one candidate's steps",
    "flows/pipeline.py:benchmark_target": "hands the graph the spec to lay out the target's benchmark step",
    "flows/pipeline.py:_build_everywhere": "sends each target to its pool",
    "flows/plan.py:pipeline_rows": "walks the graph the flow runs",
    "tasks/graph.py:candidate_steps": "lays out the steps, giving each its settings",
    "tasks/graph.py:benchmark_step": "lays out the steps, giving each its settings",
    "tasks/graph.py:pipeline_steps": "lays out the steps, giving each its settings",
    "tasks/graph.py:judge_steps": "lays out the steps, giving each its settings",
    "tasks/registry/runs.py:pipeline_run": "the parent run logs every setting of the pipeline as a param",
    "tasks/stages/precision.py:PrecisionConfig.of": "the precision stage's settings, narrowed with its backend rules",
    "tasks/stages/int8_fallback.py:FallbackConfig.of": "the int8 accuracy fallback's settings (model, gates), built",
    "tasks/stages/int8_fallback.py:gated_metrics": "the accuracy gates the fallback aims at, read for its settings",
    "tasks/judge/steps.py:Judging.spec": "the judging steps' state: each builds its settings from the pipeline as "
                                         "loaded, and a judging step of a plugin may read any of it",
}


def _holders(root: Path) -> set[str]:
    """`path:qualified name` of every function with a parameter, and every class with a field, typed with
    PipelineSpec, in tasks/ (but tasks/config/, where settings are built from a spec) and flows/."""
    found = set()
    files = [p for package in ("tasks", "flows") for p in sorted((root / package).rglob("*.py"))
             if not p.is_relative_to(root / "tasks" / "config")]
    for path in files:
        where = path.relative_to(root).as_posix()

        def visit(node: ast.AST, prefix: str) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.ClassDef):
                    for field in child.body:
                        if isinstance(field, ast.AnnAssign) and "PipelineSpec" in ast.unparse(field.annotation):
                            found.add(f"{where}:{prefix}{child.name}.{ast.unparse(field.target)}")
                    visit(child, f"{prefix}{child.name}.")
                elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                    arguments = child.args
                    params = [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]
                    if any(a.annotation is not None and "PipelineSpec" in ast.unparse(a.annotation) for a in params):
                        found.add(f"{where}:{prefix}{child.name}")
                    visit(child, f"{prefix}{child.name}.")

        visit(ast.parse(path.read_text(encoding="utf-8")), "")
    return found


def test_only_the_listed_functions_hold_the_whole_spec() -> None:
    found = _holders(REPO)
    unlisted, gone = sorted(found - HOLDERS.keys()), sorted(HOLDERS.keys() - found)
    assert not unlisted, f"these take a whole PipelineSpec; give them the settings they read: {unlisted}"
    assert not gone, f"these no longer take a PipelineSpec: remove them from HOLDERS: {gone}"
    assert len(HOLDERS) <= 20


def test_a_new_holder_is_found_in_a_method_a_field_or_a_nested_function(tmp_path: Path) -> None:
    module = tmp_path / "tasks" / "judge" / "verdicts.py"
    module.parent.mkdir(parents=True)
    module.write_text("class Verdict:\n    spec: PipelineSpec\n\n    def of(cls, spec: 'PipelineSpec'): ...\n\n"
                      "def outer():\n    def inner(*, spec: PipelineSpec | None = None): ...\n")
    (tmp_path / "tasks" / "config").mkdir()
    (tmp_path / "tasks" / "config" / "built.py").write_text("def of(spec: PipelineSpec): ...\n")
    (tmp_path / "flows").mkdir()
    assert _holders(tmp_path) == {"tasks/judge/verdicts.py:Verdict.spec", "tasks/judge/verdicts.py:Verdict.of",
                                  "tasks/judge/verdicts.py:outer.inner"}
