"""What a user finds in the MLflow UI after a pipeline run: one parent run, one child per candidate,
the same metric names every time, the engine and reports downloadable, failures with their error."""

from __future__ import annotations

import dataclasses
import platform
import uuid
from pathlib import Path

import mlflow
import onnxruntime
import pytest
from mlflow.tracking import MlflowClient

from tasks.config.settings import RegistrySettings, RunSettings
from tasks.outcome import Decision, GateResult
from tasks.registry import tracking
from tasks.runtime.store import ArtifactStore
from tests.fixtures.candidates import candidate_outcome, failed_outcome, pipeline_spec

pytestmark = pytest.mark.usefixtures("mlflow_server")


def _unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def _artifact_files(client: MlflowClient, run_id: str, path: str = "") -> set[str]:
    files = set()
    for item in client.list_artifacts(run_id, path or None):
        files |= _artifact_files(client, run_id, item.path) if item.is_dir else {item.path}
    return files


def test_candidate_run_nests_under_pipeline_run_with_its_tags_params_metrics_and_artifacts(tmp_path: Path) -> None:
    spec = pipeline_spec(_unique("track"))
    outcome = candidate_outcome(ArtifactStore(tmp_path / "artifacts"), spec, "int8", "cpu", throughput=400.0)
    with tracking.pipeline_run(spec, "nightly-1", {"trigger": "schedule"}) as parent_id:
        child_id = tracking.log_candidate(parent_id, RunSettings.of(spec), outcome)

    client = MlflowClient()
    parent, child = client.get_run(parent_id), client.get_run(child_id)
    assert client.get_experiment(parent.info.experiment_id).name == f"smelter/{spec.name}"
    assert parent.info.run_name == "nightly-1" and parent.info.status == "FINISHED"
    assert parent.data.tags["pipeline"] == spec.name
    assert parent.data.tags["model"] == "sentence-transformers/all-MiniLM-L6-v2"
    assert parent.data.params["precisions"] == '["fp32", "int8"]'
    assert parent.data.params["performance.gates.p99_ms.max"] == "50.0"
    assert parent.data.params["trigger"] == "schedule"

    assert child.info.run_name == f"{spec.name}/int8/cpu" and child.info.status == "FINISHED"
    tags = child.data.tags
    assert tags["mlflow.parentRunId"] == parent_id
    assert {k: tags[k] for k in ("candidate", "precision", "target", "arch", "backend", "backend_version",
                                 "cache_key", "gate", "status")} == {
        "candidate": f"{spec.name}/int8/cpu", "precision": "int8", "target": "cpu", "arch": f"cpu-{platform.machine()}",
        "backend": "onnxruntime", "backend_version": onnxruntime.__version__, "cache_key": outcome.cache_key,
        "gate": "passed", "status": "undecided"}, "its decision is recorded later (finish_candidate)"
    assert tags["mlflow.note.content"].startswith("**undecided**: passed its gates, not decided yet")
    assert tags["gate_reasons"] == ""
    assert child.data.params["precision.name"] == "int8"
    assert child.data.params["target.backend"] == "onnxruntime"
    assert child.data.params["precision.calibration.samples"] == "16"

    metrics = child.data.metrics
    assert metrics["accuracy.cosine_mean"] == pytest.approx(0.9988)
    assert metrics["throughput"] == 400.0 and metrics["p99_ms"] == 10.0
    assert {"p50_ms", "p90_ms", "speedup_vs_reference", "build_seconds", "engine_bytes",
            "b1_s16.p50_ms", "b4_s16.throughput", "b4_s16.reference_p99_ms"} <= set(metrics)

    files = _artifact_files(client, child_id)
    assert {"engine/model.onnx", "engine/engine.json", "engine/manifest.json",
            "stages/validate/manifest.json", "stages/validate/report.json",
            "stages/accuracy/per_sample.csv", "stages/benchmark/samples.csv",
            "tables/accuracy_per_sample.json", "tables/benchmark_points.json", "tables/benchmark_samples.json",
            "plots/latency.png", "engine_card.md"} <= files
    engine = Path(mlflow.artifacts.download_artifacts(run_id=child_id, artifact_path="engine",
                                                      dst_path=str(tmp_path / "download")))
    assert (engine / "model.onnx").read_bytes() == outcome.stages["build"].file("model.onnx").read_bytes()
    card = mlflow.artifacts.load_text(f"runs:/{child_id}/engine_card.md")
    assert f"# {spec.name}/int8/cpu" in card and outcome.cache_key in card

    contexts = {tag.value for d in child.inputs.dataset_inputs for tag in d.tags if tag.key == "mlflow.data.context"}
    assert contexts == {"evaluation", "calibration"}


def test_metric_names_line_up_across_candidates(tmp_path: Path) -> None:
    spec = pipeline_spec(_unique("track"))
    store = ArtifactStore(tmp_path)
    with tracking.pipeline_run(spec, "run", {}) as parent_id:
        record = RunSettings.of(spec)
        cpu = tracking.log_candidate(parent_id, record, candidate_outcome(store, spec, "int8", "cpu", throughput=400.0))
        gpu = tracking.log_candidate(parent_id, record, candidate_outcome(store, spec, "fp32", "sm90", throughput=900.0))
    client = MlflowClient()
    assert set(client.get_run(cpu).data.metrics) == set(client.get_run(gpu).data.metrics)
    assert client.get_run(gpu).data.tags["arch"] == "sm90"


def test_rejected_and_failed_candidates_are_logged_with_reasons(tmp_path: Path) -> None:
    spec = pipeline_spec(_unique("track"))
    store = ArtifactStore(tmp_path)
    rejected = candidate_outcome(store, spec, "fp32", "cpu", throughput=100.0, passed=False)
    failed = failed_outcome(store, spec, "int8", "cpu")
    with tracking.pipeline_run(spec, "run", {}) as parent_id:
        rejected_id = tracking.log_candidate(parent_id, RunSettings.of(spec), rejected)
        failed_id = tracking.log_candidate(parent_id, RunSettings.of(spec), failed)
    client = MlflowClient()
    assert client.get_run(rejected_id).data.tags["gate"] == "failed"
    assert client.get_run(rejected_id).data.tags["gate_reasons"] == "performance: p99_ms: 80 > max 50"

    run = client.get_run(failed_id)
    assert run.info.status == "FAILED"
    assert run.data.tags["status"] == "failed" and run.data.tags["failed_stage"] == "build"
    assert "invalid graph" in run.data.tags["error"]
    files = _artifact_files(client, failed_id)
    assert "stages/validate/report.json" in files and not any(f.startswith("engine/") for f in files)
    assert "invalid graph" in mlflow.artifacts.load_text(f"runs:/{failed_id}/engine_card.md")


def test_a_candidate_timed_on_a_busy_machine_is_pending_not_a_gate_failure(tmp_path: Path) -> None:
    """Its run's gate tag, its engine card and the parent run's description say pending, never failed or none."""
    spec = pipeline_spec(_unique("track"))
    outcome = candidate_outcome(ArtifactStore(tmp_path / "artifacts"), spec, "int8", "cpu", throughput=400.0)
    busy = "machine busy (other processes used 68% of the CPU while it was timed); speed not judged"
    outcome.status, outcome.decision = "pending", Decision(busy)
    outcome.gates = [GateResult("accuracy", True), GateResult("performance", False, (f"inconclusive: {busy}",),
                                                              inconclusive=True)]
    with tracking.pipeline_run(spec, "nightly-1", {}) as parent_id:
        child_id = tracking.log_candidate(parent_id, RunSettings.of(spec), outcome)
        tracking.record_gates(child_id, outcome)
        tracking.finish_candidate(child_id, RunSettings.of(spec), outcome)
        tracking.describe_pipeline_run(parent_id, [outcome])

    client = MlflowClient()
    assert client.get_run(child_id).data.tags["gate"] == "pending"
    card = mlflow.artifacts.load_text(f"runs:/{child_id}/engine_card.md")
    assert "Status: **pending**\n" in card and "gates failed" not in card
    parent = client.get_run(parent_id).data.tags
    assert parent["status"] == "1 pending" and "| **pending** |" in parent["mlflow.note.content"]


def test_a_cached_engine_already_uploaded_by_an_earlier_run_is_not_uploaded_again(tmp_path: Path) -> None:
    """A rejected engine is re-judged every night: its files go to MLflow once, later runs name that copy."""
    spec = pipeline_spec(_unique("track"))
    first = candidate_outcome(ArtifactStore(tmp_path), spec, "fp32", "cpu", throughput=100.0, passed=False)
    first.stages["build"] = dataclasses.replace(first.stages["build"], cached=True)
    runs = []
    for _ in range(3):
        with tracking.pipeline_run(spec, "nightly", {}) as parent_id:
            runs.append(tracking.log_candidate(parent_id, RunSettings.of(spec), first))
    client = MlflowClient()
    assert any(f.startswith("engine/") for f in _artifact_files(client, runs[0]))
    for later in runs[1:]:
        assert not any(f.startswith("engine/") for f in _artifact_files(client, later)), "uploaded again"
        assert tracking.engine_source(later) == f"runs:/{runs[0]}/engine"
        assert client.get_run(later).data.tags["engine_sha256"] == client.get_run(runs[0]).data.tags["engine_sha256"]
    first.run_id = runs[2]
    first.stages["build"] = dataclasses.replace(first.stages["build"], path=tmp_path / "not-on-this-host")
    fetched = tracking.engine_dir(first, tmp_path / "fetched")
    assert (fetched / "model.onnx").read_bytes() == (tmp_path / spec.name / "build" / first.cache_key /
                                                     "model.onnx").read_bytes()

    other = candidate_outcome(ArtifactStore(tmp_path), spec, "fp32", "cpu", throughput=100.0, passed=False,
                              variant="rebuilt")
    other.stages["build"] = dataclasses.replace(other.stages["build"], cached=True)
    with tracking.pipeline_run(spec, "nightly", {}) as parent_id:
        rebuilt = tracking.log_candidate(parent_id, RunSettings.of(spec), other)
    assert any(f.startswith("engine/") for f in _artifact_files(client, rebuilt)), "another engine is uploaded"


def test_pipeline_run_is_marked_failed_when_the_flow_raises() -> None:
    spec = pipeline_spec(_unique("track"))
    with pytest.raises(RuntimeError, match="export broke"):
        with tracking.pipeline_run(spec, "run", {}) as parent_id:
            raise RuntimeError("export broke")
    assert MlflowClient().get_run(parent_id).info.status == "FAILED"


def test_no_champion_before_any_promotion() -> None:
    assert tracking.champion(RegistrySettings.of(pipeline_spec(_unique("track"))), "cpu") is None
