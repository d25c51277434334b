"""A candidate's child run as the hand-off of a fanned-out build: written once, judged, read back.

The build logs everything known about the candidate, its stage results included (OUTCOME_RECORD);
the parent records its gate verdict on it and rebuilds every outcome from MLflow alone, so hosts hand
back run ids, never pickled objects.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import mlflow
import pandas as pd
from mlflow.exceptions import MlflowException
from mlflow.tracking.context.registry import resolve_tags
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID

from tasks.config.settings import RunSettings
from tasks.config.spec import Candidate
from tasks.metrics import stage_metrics
from tasks.outcome import CandidateOutcome
from tasks.registry.card import engine_card
from tasks.registry.client import _client
from tasks.registry.runs import (MAX_TAG_CHARS, OWNER_TAG, _ended_by, _experiment_id, before_decision,
                                 candidate_params, candidate_tags, gate_tag, headline_metrics, owner_tag, rounded,
                                 stage_seconds)
from tasks.registry.uploads import _log_engine
from tasks.runtime import killpoints
from tasks.runtime.store import MANIFEST, StageResult

REPORT_FILES = {"validate": ("report.json",), "accuracy": ("per_sample.csv", "three_way.json"),
                "benchmark": ("samples.csv",)}
COMPARISON_COLUMNS = ["engine", "versus", "ratio", "ci_low", "ci_high", "conclusive"]  # what a decision reads
OUTCOME_RECORD = "smelter/outcome.json"  # a candidate's stage results, as the parent run rebuilds them


def log_candidate(parent_run_id: str, record: RunSettings, outcome: CandidateOutcome,
                  extra_tags: dict[str, str] | None = None) -> str:
    """A child run holding everything known about one candidate, even when it failed midway.

    Returns the child run id. The run ends FAILED for a failed candidate so the UI shows it red.
    `extra_tags` say where it was built (host, pool, flow run). The run also holds the candidate's
    stage results (OUTCOME_RECORD), so the parent can judge it from MLflow alone (`candidate_outcomes`).
    """
    client = _client()
    metrics = stage_metrics(outcome.stages)
    tags = resolve_tags(candidate_tags(record, outcome) | (extra_tags or {})
                        | {MLFLOW_PARENT_RUN_ID: parent_run_id, OWNER_TAG: owner_tag()} | before_decision(outcome))
    created = client.create_run(_experiment_id(client, record.pipeline), start_time=_work_started_ms(outcome),
                                tags=tags, run_name=outcome.candidate.name)
    run = mlflow.start_run(run_id=created.info.run_id, nested=True)
    status = "FAILED"
    try:
        mlflow.log_params(candidate_params(record, outcome))
        # the headline first: the run page lists metrics in the order they were logged, not by name
        mlflow.log_metrics(rounded(headline_metrics(record.gated_accuracy, metrics) | metrics
                                   | stage_seconds(outcome.stages)))
        _log_engine(record.pipeline, outcome)
        _log_stage_files(outcome.stages)
        _log_tables(outcome.stages)
        if (benchmark := outcome.stages.get("benchmark")) and benchmark.file("latency.png").is_file():
            mlflow.log_artifact(str(benchmark.file("latency.png")), "plots")
        mlflow.log_text(engine_card(record, outcome, metrics), "engine_card.md")  # rewritten by finish_candidate
        _log_datasets(record, outcome)
        mlflow.log_dict(outcome_record(outcome), OUTCOME_RECORD)
        killpoints.reach("candidate.logged")
        status = "FAILED" if outcome.status == "failed" else "FINISHED"
    except BaseException as e:
        status = _ended_by(e)
        raise
    finally:
        mlflow.end_run(status)
    return run.info.run_id


def _log_stage_files(stages: dict[str, StageResult]) -> None:
    for name, stage in stages.items():
        if name == "build":
            continue
        for file in (MANIFEST, *REPORT_FILES.get(name, ())):
            if stage.file(file).is_file():
                mlflow.log_artifact(str(stage.file(file)), f"stages/{name}")


def _log_tables(stages: dict[str, StageResult]) -> None:
    accuracy, benchmark = stages.get("accuracy"), stages.get("benchmark")
    if accuracy and accuracy.file("per_sample.csv").is_file():
        mlflow.log_table(pd.read_csv(accuracy.file("per_sample.csv")), "tables/accuracy_per_sample.json")
    if benchmark and benchmark.outputs.get("points"):
        mlflow.log_table(pd.DataFrame(benchmark.outputs["points"]), "tables/benchmark_points.json")
    if benchmark and benchmark.outputs.get("decode"):
        mlflow.log_table(pd.DataFrame(benchmark.outputs["decode"]), "tables/benchmark_decode.json")
    if benchmark and benchmark.file("samples.csv").is_file():
        mlflow.log_table(pd.read_csv(benchmark.file("samples.csv")), "tables/benchmark_samples.json")
    if benchmark and benchmark.outputs.get("comparisons"):
        table = pd.DataFrame(benchmark.outputs["comparisons"])
        first = [c for c in COMPARISON_COLUMNS if c in table.columns]
        mlflow.log_table(table[first + [c for c in table.columns if c not in first]], "tables/comparisons.json")


def _log_datasets(record: RunSettings, outcome: CandidateOutcome) -> None:
    """The real text this engine was calibrated and judged on, so a data change shows in the UI."""
    uses = [("evaluation", record.eval_path, record.eval_samples)]
    if record.calibrated(outcome.candidate) and record.calibration_path is not None:
        uses.append(("calibration", record.calibration_path, record.calibration.samples))
    for context, path, samples in uses:
        if not path.is_file():
            continue
        lines = [line for line in path.read_text().splitlines() if line.strip()][:samples]
        with warnings.catch_warnings():  # MLflow registers its local-file source twice and says so on every call
            warnings.filterwarnings("ignore", message="The specified dataset source can be interpreted")
            dataset = mlflow.data.from_pandas(pd.DataFrame({"text": lines}), source=str(path), name=path.name)
        mlflow.log_input(dataset, context=context)


def _work_started_ms(outcome: CandidateOutcome) -> int | None:
    """When this run began producing the candidate's stages, so its MLflow run spans the real work;
    None (now) when everything was reused."""
    starts = [stage.manifest["created_unix"] - stage.manifest.get("seconds", 0.0)
              for stage in outcome.stages.values() if not stage.cached and "created_unix" in stage.manifest]
    return int(min(starts) * 1000) if starts else None


def outcome_record(outcome: CandidateOutcome) -> dict[str, Any]:
    """What a build hands back through MLflow: each stage's key, whether it was reused, and its manifest
    (the outputs gates, decisions and promotion read), why a damaged earlier output was replaced, plus
    how the build ended."""
    return {"candidate": outcome.candidate.model_dump(), "status": outcome.status, "error": outcome.error,
            "failed_stage": outcome.failed_stage,
            "stages": {name: {"key": s.key, "cached": s.cached, "manifest": s.manifest, "repaired": s.repaired,
                              "kept": s.kept}
                       for name, s in outcome.stages.items()}}


def candidate_outcomes(pipeline: str, parent_run_id: str, store_root: Path) -> dict[str, CandidateOutcome]:
    """Every candidate logged under a parent run, rebuilt from its MLflow run (keyed by candidate name).

    This is the join of a fanned-out build: hosts hand back run ids, never pickled objects. A stage's
    `path` is where this host's artifact store keeps that key; it exists only when the store is shared
    (see `engine_dir` for the engine itself). The newest run wins if a candidate was logged twice.
    """
    client = _client()
    runs = client.search_runs([_experiment_id(client, pipeline)],
                              filter_string=f"tags.`{MLFLOW_PARENT_RUN_ID}` = '{parent_run_id}'",
                              order_by=["attributes.start_time ASC"], max_results=5000)
    found: dict[str, CandidateOutcome] = {}
    for run in runs:
        outcome = candidate_outcome(run.info.run_id, store_root)
        if outcome is not None:
            found[outcome.candidate.name] = outcome
    return found


def candidate_outcome(run_id: str, store_root: Path) -> CandidateOutcome | None:
    """One candidate's outcome from its run's OUTCOME_RECORD; None for a run without one."""
    try:
        record = mlflow.artifacts.load_dict(f"runs:/{run_id}/{OUTCOME_RECORD}")
    except (MlflowException, OSError):
        return None
    candidate = Candidate(**record["candidate"])
    stages = {name: StageResult(candidate.pipeline, name, s["key"], store_root / candidate.pipeline / name / s["key"],
                                s["manifest"], cached=s["cached"], repaired=s.get("repaired"), kept=s.get("kept"))
              for name, s in record["stages"].items()}
    return CandidateOutcome(candidate, record["status"], stages=stages, error=record["error"],
                            failed_stage=record["failed_stage"], run_id=run_id)


def record_gates(run_id: str, outcome: CandidateOutcome) -> None:
    """The parent's gate verdict on a run a build logged before it was judged."""
    tags = {"gate": gate_tag(outcome), "gate_reasons": "; ".join(outcome.gate_reasons)[:MAX_TAG_CHARS]}
    tags |= before_decision(outcome)
    client = _client()
    for key, value in tags.items():
        client.set_tag(run_id, key, value)
