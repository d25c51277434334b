"""What the MLflow UI shows a person: runs that span the real work, headline metrics first, whether
anything was rebuilt, the engine's signature on the model version, and the decisions on the parent run."""

from __future__ import annotations

import dataclasses
import uuid
from pathlib import Path

import mlflow
import pytest
from mlflow.tracking import MlflowClient

from tasks.config.settings import RunSettings
from tasks.config.spec import registered_model_name
from tasks.outcome import CandidateOutcome, Decision
from tasks.registry import tracking
from tasks.runtime.store import ArtifactStore
from tests.fixtures.candidates import candidate_outcome, failed_outcome, pipeline_spec

pytestmark = pytest.mark.usefixtures("mlflow_server")
EXPORTED_IO = {"inputs": {"input_ids": {"dtype": "int64", "shape": ["batch_size", "sequence_length"]},
                          "attention_mask": {"dtype": "int64", "shape": ["batch_size", "sequence_length"]}},
               "outputs": {"last_hidden_state": {"dtype": "float32",
                                                 "shape": ["batch_size", "sequence_length", 32]}}}


def with_export(store: ArtifactStore, outcome: CandidateOutcome) -> CandidateOutcome:
    """The candidate's exported graph, described as the export stage records it."""
    with store.writing(outcome.candidate.pipeline, "export", f"export-{uuid.uuid4().hex[:8]}") as w:
        (w.dir / "model.onnx").write_bytes(b"graph")
        w.outputs.update(EXPORTED_IO)
    outcome.stages = {"export": w.result, **outcome.stages}
    return outcome


def test_candidate_run_spans_its_work_and_leads_with_headline_metrics(tmp_path: Path) -> None:
    spec = pipeline_spec(f"ui-{uuid.uuid4().hex[:8]}")
    store = ArtifactStore(tmp_path / "artifacts")
    outcome = with_export(store, candidate_outcome(store, spec, "fp32", "cpu", throughput=400.0))
    with tracking.pipeline_run(spec, "nightly", {}) as parent_id:
        child_id = tracking.log_candidate(parent_id, RunSettings.of(spec), outcome)
    child = MlflowClient().get_run(child_id)

    first_start = min(s.manifest["created_unix"] - s.manifest["seconds"] for s in outcome.stages.values())
    assert child.info.start_time == int(first_start * 1000) < child.info.end_time
    metrics = child.data.metrics
    assert (metrics["_throughput"], metrics["_p99_ms"], metrics["_cosine_mean"]) == (400.0, 10.0, 0.9988)
    assert metrics["_speedup"] == metrics["speedup_vs_reference"]
    assert metrics["_engine_mb"] == pytest.approx(outcome.stages["build"].outputs["engine_bytes"] / 1e6)
    headline = sorted(k for k in metrics if k.startswith("_"))
    assert sorted(metrics)[:len(headline)] == headline, "headline metrics sort before the other ~40"
    assert metrics["stage_seconds.build"] == outcome.stages["build"].manifest["seconds"]
    assert child.data.tags["rebuilt"] == "export,validate,build,accuracy,benchmark"
    assert child.data.tags["mlflow.parentRunId"] == parent_id


def test_model_version_carries_the_engine_signature(tmp_path: Path) -> None:
    spec = pipeline_spec(f"sig-{uuid.uuid4().hex[:8]}")
    store = ArtifactStore(tmp_path / "artifacts")
    outcome = with_export(store, candidate_outcome(store, spec, "int8", "cpu", throughput=300.0))
    with tracking.pipeline_run(spec, "nightly", {}) as parent_id:
        child_id = tracking.log_candidate(parent_id, RunSettings.of(spec), outcome)
    name = registered_model_name(spec.name, "cpu")
    tracking.ensure_registered_model(name, "engines", {})
    version = tracking.create_version(name, child_id, {"candidate": outcome.candidate.name})

    signature = mlflow.models.Model.load(f"models:/{name}/{version.version}").signature
    assert {s.name: (s.type.name, s.shape) for s in signature.inputs.inputs} == {
        "input_ids": ("int64", (-1, -1)), "attention_mask": ("int64", (-1, -1))}
    assert [(s.name, s.shape) for s in signature.outputs.inputs] == [("last_hidden_state", (-1, -1, 32))]


def test_unchanged_rerun_says_nothing_was_rebuilt_and_the_parent_run_summarises_the_decisions(tmp_path: Path) -> None:
    spec = pipeline_spec(f"re-{uuid.uuid4().hex[:8]}")
    store = ArtifactStore(tmp_path / "artifacts")
    kept = candidate_outcome(store, spec, "fp32", "cpu", throughput=400.0)
    kept.stages = {name: dataclasses.replace(stage, cached=True) for name, stage in kept.stages.items()}
    kept.status, kept.model_version = "passed", "3"
    kept.decision = Decision("enc/int8/cpu is faster")
    rejected = candidate_outcome(store, spec, "int8", "cpu", throughput=100.0, passed=False)
    rejected.stages = {name: dataclasses.replace(stage, cached=True) for name, stage in rejected.stages.items()}
    broken = failed_outcome(store, spec, "fp32", "sm90")
    broken.stages = {name: dataclasses.replace(stage, cached=True) for name, stage in broken.stages.items()}
    with tracking.pipeline_run(spec, "nightly", {}) as parent_id:
        child_id = tracking.log_candidate(parent_id, RunSettings.of(spec), kept)
        tracking.describe_pipeline_run(parent_id, [broken, rejected, kept])  # shown champion first

    client = MlflowClient()
    child = client.get_run(child_id)
    assert child.data.tags["rebuilt"] == "none"
    assert all(v == 0.0 for k, v in child.data.metrics.items() if k.startswith("stage_seconds."))
    parent = client.get_run(parent_id)
    assert parent.data.tags["rebuilt"] == "false"
    description = parent.data.tags["mlflow.note.content"]
    assert description.splitlines()[2:] == [
        "| fp32/cpu | **passed** v3 | - | enc/int8/cpu is faster |",
        "| int8/cpu | **rejected** | - | p99_ms: 80 > max 50 |",
        "| fp32/sm90 | **failed** | - | build: onnxruntime could not load model.onnx: invalid graph |"]
    assert parent.data.tags["status"] == "1 passed, 1 rejected, 1 failed", "the collapsed row's status cell"
    assert parent.data.tags["decision_reason"] == ("fp32/cpu passed v3 · int8/cpu rejected: p99_ms · "
                                                   "fp32/sm90 failed: build"), "each candidate's outcome in a word"


def test_experiment_opens_on_runs_and_a_child_run_says_its_status_and_why(tmp_path: Path) -> None:
    spec = pipeline_spec(f"kind-{uuid.uuid4().hex[:8]}")
    store = ArtifactStore(tmp_path / "artifacts")
    rejected = with_export(store, candidate_outcome(store, spec, "int8", "cpu", throughput=100.0, passed=False))
    client = MlflowClient()
    client.create_experiment(tracking.experiment_name(spec.name))  # as an older smelter made it: no kind
    with tracking.pipeline_run(spec, "nightly", {}) as parent_id:
        child_id = tracking.log_candidate(parent_id, RunSettings.of(spec), rejected)
        tracking.finish_candidate(child_id, RunSettings.of(spec), rejected)

    experiment = client.get_experiment_by_name(tracking.experiment_name(spec.name))
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development", "not the GenAI traces page"
    description = client.get_run(child_id).data.tags["mlflow.note.content"]
    assert description.startswith("**rejected**: ") and "p99_ms: 80 > max 50" in description


def test_comparison_table_leads_with_what_the_decision_reads(tmp_path: Path) -> None:
    spec = pipeline_spec(f"cmp-{uuid.uuid4().hex[:8]}")
    store = ArtifactStore(tmp_path / "artifacts")
    outcome = with_export(store, candidate_outcome(store, spec, "int8", "cpu", throughput=300.0))
    row = {"step": "prefill", "batch": 4, "seq": 16, "past": 0, "engine": "engine", "versus": "champion",
           "ratio": 1.31, "ci_low": 1.2, "ci_high": 1.4, "half_width": 0.08, "rounds": 12, "conclusive": True}
    outcome.stages["benchmark"].outputs["comparisons"] = [dict(sorted(row.items()))]  # as a manifest reads back
    with tracking.pipeline_run(spec, "nightly", {}) as parent_id:
        child_id = tracking.log_candidate(parent_id, RunSettings.of(spec), outcome)

    table = mlflow.artifacts.load_dict(f"runs:/{child_id}/tables/comparisons.json")
    assert table["columns"][:6] == ["engine", "versus", "ratio", "ci_low", "ci_high", "conclusive"]
    assert sorted(table["columns"]) == sorted(row)
