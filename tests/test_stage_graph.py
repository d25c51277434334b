"""The stage graph on real stages: damaged cached outputs are rebuilt, and `smelter plan` lists what a run runs."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from tasks import graph
from tasks.config.spec import PipelineSpec, load
from tasks.measure.hostload import CONTENDED_SHARE
from tasks.runtime.stage_runner import run_stage
from tasks.runtime.store import CORRUPT_DIR, ArtifactStore, StageResult
from tests.test_benchmark import busy_machine  # noqa: F401  (a fixture)
from tests.test_store import flip

STAGES = ("export", "validate", "precision", "build", "accuracy", "benchmark")
JUDGING = ("gate", "decide", "promote", "notify")  # no key: they run on every run


def run_chain(spec: PipelineSpec, store: ArtifactStore) -> dict[str, StageResult]:
    """Every stage of the one candidate `tiny/fp32/cpu`, through the same graph and runner the flow uses."""
    [candidate] = spec.candidates()
    done: dict[graph.Ref, StageResult] = {}
    for step in graph.candidate_steps(spec, candidate, store):
        done[step.ref] = run_stage(graph.call_work(step, done), store)
    bench = graph.benchmark_step(spec, candidate.target, [candidate.name], None)
    done[bench.ref] = run_stage(graph.call_work(bench, done), store)
    return {stage: result for (stage, _node), result in done.items()}


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory, tiny_bert_dir: Path) -> tuple[PipelineSpec, ArtifactStore]:
    from tests.fixtures.models import write_pipelines

    root = tmp_path_factory.mktemp("graph")
    spec = load(write_pipelines(root, tiny_bert_dir, "feature-extraction")).pipelines["tiny"]
    return spec, ArtifactStore(root / "artifacts")


DEPENDENTS = {"export": ("validate", "precision", "build", "accuracy", "benchmark"),
              "precision": ("build", "accuracy", "benchmark"), "build": ("accuracy", "benchmark")}


def remeasured(before: StageResult, after: StageResult) -> bool:
    """A benchmark taken while the machine was busy is measured again on the next run, by design."""
    return after.stage == "benchmark" and bool(before.outputs.get("host", {}).get("contended"))


CORRUPTIONS = [("export", "model.onnx"), ("precision", "model.onnx"), ("build", "engine"),
               ("validate", "report.json"), ("accuracy", "per_sample.csv"), ("accuracy", "manifest.json"),
               ("benchmark", "samples.csv")]


@pytest.mark.parametrize(("stage", "name"), CORRUPTIONS)
def test_a_damaged_cached_output_is_detected_moved_aside_and_rebuilt(
        chain: tuple[PipelineSpec, ArtifactStore], stage: str, name: str) -> None:
    spec, store = chain
    before = run_chain(spec, store)
    target = before[stage]
    if name == "engine":
        name = target.outputs["engine_file"]
    path = target.file(name)
    if name == "manifest.json":  # a result changed, the file still valid JSON of the same size
        text = path.read_text()
        metric = f'"cosine_mean": {target.outputs["metrics"]["cosine_mean"]}'
        assert metric in text
        path.write_text(text.replace(metric, metric[:-1] + ("1" if metric[-1] != "1" else "2")))
    else:
        size = path.stat().st_size
        flip(path, offset=size // 3, count=192)
        assert path.stat().st_size == size

    after = run_chain(spec, store)
    assert after[stage].repaired and name in after[stage].repaired, after[stage].repaired
    assert not after[stage].cached and after[stage].key == target.key
    same = after[stage].content == target.content
    for other in STAGES:
        if other == stage or after[other].repaired:
            assert other == stage, f"{other} was repaired too"
            continue
        if other not in DEPENDENTS.get(stage, ()):
            assert after[other].cached or remeasured(before[other], after[other]), f"{other} ran again"
        elif same:
            assert after[other].cached or remeasured(before[other], after[other]), \
                f"{other}: the rebuilt {stage} is byte-identical, so what was judged of it still holds"
        else:
            assert not after[other].cached and after[other].key != before[other].key, \
                f"{other}: the rebuilt {stage} differs from the one judged before, so it is judged again"
    assert store.lookup(spec.name, stage, target.key) is not None, "the rebuilt output verifies"
    assert len(list((target.path.parent / CORRUPT_DIR).glob(f"{target.key}-*"))) >= 1
    if stage == "accuracy":
        assert after[stage].outputs["metrics"] == target.outputs["metrics"] != {}, "the result is the real one again"


def task_run_refs(pipeline: str) -> dict[tuple[str, str], str]:
    """(node, stage) -> state of every stage task run of this pipeline in the Prefect server."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterName

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(task_run_filter=TaskRunFilter(name=TaskRunFilterName(like_=f"{pipeline}")),
                                     limit=200)
    refs = {}
    for run in runs:
        node, _, stage = run.name.rpartition("/")
        if stage in STAGES + JUDGING and node.split("/")[0] == pipeline:
            refs[(node, stage)] = run.state.name if run.state else "?"
    return refs


def test_plan_says_a_benchmark_published_while_the_machine_was_busy_runs_again(
        chain: tuple[PipelineSpec, ArtifactStore], tmp_path: Path, request: pytest.FixtureRequest) -> None:
    from flows.plan import pipeline_rows

    spec, _ = chain  # judged with the default contention threshold (the suite's pipelines ignore the load)
    spec = spec.model_copy(update={"benchmark": spec.benchmark.model_copy(update={"contended_above": CONTENDED_SHARE})})
    store = ArtifactStore(tmp_path / "artifacts")
    request.getfixturevalue("busy_machine")
    assert run_chain(spec, store)["benchmark"].outputs["host"]["contended"]
    rows = {r["stage"]: r for r in pipeline_rows(spec, store)}
    assert rows["build"]["state"] == "cached"
    assert (rows["benchmark"]["state"], rows["benchmark"]["note"]) == (
        "to-run", "published while the machine was busy: measured again")


@pytest.mark.slow
def test_plan_lists_the_stages_a_run_executes_with_a_torch_source_target(
        pipeline_factory: Callable[..., Path], tiny_bert_dir: Path, mlflow_server: str, prefect_server: None,
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from flows.cli import main
    from flows.plan import pipeline_rows

    name = f"plan-{uuid.uuid4().hex[:6]}"
    path = pipeline_factory(
        tiny_bert_dir, "feature-extraction", precisions=["fp32", "bf16"], name=name,
        targets=[{"name": "cpu", "backend": "onnxruntime", "threads": 1},
                 {"name": "cpu-inductor", "backend": "inductor", "device": "cpu", "format": "aoti", "threads": 1}],
        accuracy={"gates": {"cosine_mean": {"min": 0.5}}}, performance={"gates": {"p99_ms": {"max": 60000}}})
    spec = load(path).pipelines[name]
    store = ArtifactStore(tmp_path / "artifacts")
    planned = list(pipeline_rows(spec, store))
    rows = {(r["node"], r["stage"]) for r in planned}
    torch_nodes = {f"{name}/fp32/cpu-inductor", f"{name}/bf16/cpu-inductor"}
    assert {(n, s) for n, s in rows if n in torch_nodes} == {
        (n, s) for n in torch_nodes for s in ("build", "accuracy", "gate")}
    assert (f"{name}/bf16", "precision") not in rows, "a torch-source candidate has no ONNX precision stage"
    assert {s for n, s in rows if n not in torch_nodes} == set(STAGES + JUDGING)
    assert {r["state"] for r in planned if r["stage"] in JUDGING} == {"always"}

    assert main(["run", "--json", "-f", str(path), "--artifacts", str(store.root)]) in (0, 1)
    summary = json.loads(capsys.readouterr().out)
    ran = task_run_refs(name)
    blocked = {(r["node"], r["stage"]) for r in planned if r["state"] == "blocked"}
    assert set(ran) <= rows, "the run executed no stage the plan did not list"
    assert rows - blocked <= set(ran), "every stage the plan could run was run"
    for candidate in summary["candidates"]:
        if candidate["candidate"] in torch_nodes:
            assert set(candidate["stages"]) <= {"build", "accuracy", "benchmark"}, candidate["stages"]
            if (candidate["candidate"], "build") not in blocked:
                assert candidate["failed_stage"] != "build", candidate["error"]

    replanned = {(r["node"], r["stage"]): r for r in pipeline_rows(spec, store)}
    succeeded = {ref for ref, state in ran.items() if state in ("Completed", "Cached") and ref[1] in STAGES}
    assert {ref for ref, row in replanned.items() if row["state"] == "cached"} == succeeded

    engine = next(c for c in summary["candidates"] if c["candidate"] == f"{name}/fp32/cpu")["stages"]["build"]
    build_dir = store.path(name, "build", engine["key"])
    flip(next(p for p in build_dir.iterdir() if p.name != "manifest.json"), count=256)
    row = next(r for r in pipeline_rows(spec, store) if r["node"] == f"{name}/fp32/cpu" and r["stage"] == "build")
    assert row["state"] == "to-run" and row["note"].startswith("damaged:") and build_dir.exists(), \
        "plan reports damage and moves nothing"
    assert main(["run", "--json", "-f", str(path), "--precision", "fp32", "--target", "cpu",
                 "--artifacts", str(store.root)]) == 0
    [rerun] = json.loads(capsys.readouterr().out)["candidates"]
    assert "repaired" in rerun["stages"]["build"] and not rerun["stages"]["build"]["cached"]
    [aside] = (build_dir.parent / CORRUPT_DIR).glob(f"{engine['key']}-*")
    files = [json.loads((d / "manifest.json").read_text())["files"] for d in (aside, build_dir)]
    assert rerun["stages"]["accuracy"]["cached"] == (files[0] == files[1]), \
        "the engine is judged again exactly when the rebuilt one differs from the one judged before"


def test_the_graph_orders_every_stage_by_what_it_reads(pipeline_factory: Callable[..., Path],
                                                        tiny_bert_dir: Path) -> None:
    """Precision reads a validated export; each gate its accuracy and its target's benchmark; promote every
    gate through decide; package (plans only) and notify the promotion. Every judging step has its action."""
    path = pipeline_factory(tiny_bert_dir, "feature-extraction", precisions=["fp32", "fp16"], name="order",
                            targets=[{"name": "cpu", "backend": "onnxruntime"},
                                     {"name": "h100", "backend": "tensorrt", "arch": "sm90"}])
    spec = load(path).pipelines["order"]
    steps = graph.pipeline_steps(spec, spec.candidates())
    position = {step.ref: i for i, step in enumerate(steps)}
    assert all(position[need] < position[step.ref] for step in steps for need in step.needs), "running order"
    needs = {step.ref: set(step.needs) for step in steps}
    assert ("validate", "order") in needs[("precision", "order/fp16")]
    gates = {("gate", c.name) for c in spec.candidates()}
    assert needs[("gate", "order/fp16/h100")] == {("accuracy", "order/fp16/h100"), ("benchmark", "order/h100")}
    assert needs[("decide", "order")] == gates and needs[("promote", "order")] == {("decide", "order")}
    assert needs[("package", "order")] == needs[("notify", "order")] == {("promote", "order")}
    judging = [s for s in steps if s.judges]
    assert [s.stage for s in judging] == ["gate"] * len(gates) + ["decide", "promote", "package", "notify"]
    assert all(s.work is None and callable(s.judge) for s in judging)

    cpu_only = load(pipeline_factory(tiny_bert_dir, "feature-extraction", name="cpu-only")).pipelines["cpu-only"]
    assert "package" not in {s.stage for s in graph.pipeline_steps(cpu_only, cpu_only.candidates())}, \
        "no target builds Triton plans, so nothing is packaged"


def test_judging_stages_that_read_each_other_in_a_circle_are_refused() -> None:
    from tasks.judge.steps import JUDGES, Judge, in_running_order

    def keep(judging, node):
        return judging

    first = Judge("first", "pipeline", ("second",), keep, lambda registry: "")
    second = Judge("second", "pipeline", ("gate",), keep, lambda registry: "", before=("first", "decide"))
    ordered = [j.stage for j in in_running_order((*JUDGES, first, second))]
    assert ordered.index("second") < ordered.index("first") and ordered.index("second") < ordered.index("decide")
    with pytest.raises(ValueError, match="circle: .*first, second"):
        in_running_order((*JUDGES, first, Judge("second", "pipeline", ("first",), keep, lambda registry: "")))
