"""One model's graph: export → validate → precision[p] → build[p, target] → accuracy → benchmark → gate → promote → notify.

Orchestration only. A stage that fails marks the candidates downstream of it `failed` and the
others carry on; nothing here decides what a stage computes.
"""

from __future__ import annotations

import functools
import tempfile
import traceback
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from prefect import flow, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.states import State

from flows import events, progress
from flows.stages import run_step
from tasks import benchmark, decide, gates, graph, notify, promote, tracking, triton
from tasks.champion import champion_build
from tasks.metrics import key_metrics, stage_metrics
from tasks.outcome import CandidateOutcome, Champion
from tasks.spec import Candidate, PipelineSpec, load
from tasks.store import ArtifactStore, StageResult


class _StageFailed(Exception):
    def __init__(self, stage: str, error: BaseException):
        self.stage = stage
        self.error = error
        super().__init__(f"{stage}: {error}")


def _unwrap(value: Any) -> Any:
    """A stage task that found its output cached returns Prefect's `Cached` state (so the UI shows it); the flow
    wants the StageResult inside."""
    return value.result() if isinstance(value, State) else value


class _Memo:
    """Runs each shared upstream stage once per flow run and remembers its result or failure."""

    def __init__(self) -> None:
        self._done: dict[tuple[str, str], StageResult | _StageFailed] = {}

    def get(self, stage: str, node: str, call: Any) -> StageResult:
        key = (stage, node)
        if key not in self._done:
            try:
                self._done[key] = _unwrap(call())
            except Exception as e:  # noqa: BLE001 - any stage error fails its candidates, not the run
                progress.stage_failed(node, stage, f"{type(e).__name__}: {e}")
                self._done[key] = _StageFailed(stage, e)
        done = self._done[key]
        if isinstance(done, _StageFailed):
            raise done
        return done


def build_candidate(spec: PipelineSpec, candidate: Candidate, store: ArtifactStore, memo: _Memo,
                    force: bool) -> CandidateOutcome:
    """Run the candidate's steps of the stage graph up to accuracy, reusing what siblings already ran."""
    outcome = CandidateOutcome(candidate, status="passed")
    done: dict[tuple[str, str], StageResult] = {}
    try:
        for step in graph.candidate_steps(spec, candidate, store):
            inputs = {ref: done[ref] for ref in step.needs}
            done[step.ref] = outcome.stages[step.stage] = memo.get(
                step.stage, step.node, lambda: run_step(step, inputs, store, force))
    except _StageFailed as failed:
        outcome.status = "failed"
        outcome.failed_stage = failed.stage
        outcome.error = f"{failed.stage} failed: {type(failed.error).__name__}: {failed.error}"
    return outcome


def benchmark_target(spec: PipelineSpec, target: str, outcomes: list[CandidateOutcome], champion: Champion | None,
                     store: ArtifactStore, force: bool) -> None:
    """Time every built candidate of one target side by side with the reference and the champion."""
    built = [o for o in outcomes if o.candidate.target == target and o.status != "failed"]
    if not built:
        return
    fetch = functools.partial(champion_build, spec, champion, store) if champion else None
    step = graph.benchmark_step(spec, target, [o.candidate.name for o in built], champion, fetch)
    try:
        result = _unwrap(run_step(step, {("build", o.candidate.name): o.stages["build"] for o in built}, store, force))
    except Exception as e:  # noqa: BLE001 - the target's candidates fail; other targets go on
        progress.stage_failed(step.node, "benchmark", f"{type(e).__name__}: {e}")
        for outcome in built:
            outcome.status, outcome.failed_stage = "failed", "benchmark"
            outcome.error = f"benchmark failed: {type(e).__name__}: {e}"
        return
    for outcome in built:
        outcome.stages["benchmark"] = benchmark.for_candidate(result, outcome.candidate.name, champion)


@task(name="gate", cache_policy=NO_CACHE, persist_result=False)
def gate_task(spec: PipelineSpec, outcome: CandidateOutcome, previous: dict[str, Any] | None) -> CandidateOutcome:
    measured = stage_metrics(outcome.stages)
    outcome.metrics = key_metrics(measured)
    outcome.gates = gates.evaluate(spec, measured, outcome.stages["accuracy"].outputs.get("validity"), previous)
    outcome.status = "passed" if outcome.passed_gates else "rejected"
    return outcome


def _judge_and_track(spec: PipelineSpec, outcome: CandidateOutcome, parent_run_id: str) -> CandidateOutcome:
    """Gate (unless a stage failed), then log; tasks hand back new objects, so keep what they return."""
    name = outcome.candidate.name
    if outcome.status != "failed":
        previous = tracking.previous_version(spec, outcome.candidate.target, outcome.candidate.precision,
                                             outcome.cache_key)
        outcome = gate_task.with_options(task_run_name=f"{name}/gate")(spec, outcome, previous)
    try:
        outcome.run_id = track_task.with_options(task_run_name=f"{name}/track")(parent_run_id, spec, outcome)
    except Exception as e:  # noqa: BLE001 - an unrecorded candidate may not be promoted; the others go on
        _fail(outcome, "track", e)
    return outcome


@task(name="track", cache_policy=NO_CACHE, persist_result=False)
def track_task(parent_run_id: str, spec: PipelineSpec, outcome: CandidateOutcome) -> str:
    return tracking.log_candidate(parent_run_id, spec, outcome)


@task(name="promote", cache_policy=NO_CACHE, persist_result=False)
def promote_task(spec: PipelineSpec, outcomes: list[CandidateOutcome]) -> list[CandidateOutcome]:
    return promote.promote(spec, outcomes)


@task(name="notify", cache_policy=NO_CACHE, persist_result=False)
def notify_task(spec: PipelineSpec, outcomes: list[CandidateOutcome]) -> list[dict[str, Any]]:
    return notify.notify_promotions(spec, outcomes)


@task(name="package", cache_policy=NO_CACHE, persist_result=False)
def package_task(spec: PipelineSpec, outcomes: list[CandidateOutcome]) -> int:
    """Triton model-repository entries for promoted TensorRT engines, logged to their runs."""
    with tempfile.TemporaryDirectory(prefix="smelter-triton-") as tmp:
        packages = triton.package_promoted(spec, outcomes, Path(tmp))
        for run_id, model_dir in packages.items():
            tracking.log_directory(run_id, model_dir, f"triton/{model_dir.name}")
    return len(packages)


@flow(name="smelter-pipeline", flow_run_name="{pipeline}")
def pipeline_flow(file: str, pipeline: str, precisions: list[str] | None = None, targets: list[str] | None = None,
                  force: bool = False, artifacts: str = "artifacts",
                  allow_outside_paths: bool = False) -> list[dict[str, Any]]:
    """Build, judge, record and promote every selected candidate of one pipeline."""
    spec = load(file, pipelines=[pipeline], allow_outside_paths=allow_outside_paths).pipelines[pipeline]
    candidates = spec.candidates(precisions, targets)
    store = ArtifactStore(artifacts)
    store.clean_temp(pipeline)
    memo = _Memo()
    run_name = f"{pipeline}-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}"
    with tracking.pipeline_run(spec, run_name, params={"file": file, "force": force}) as parent_run_id:
        targets = list(dict.fromkeys(c.target for c in candidates))
        champions = {t: tracking.champion(spec, t) for t in targets}
        outcomes = [build_candidate(spec, c, store, memo, force) for c in candidates]
        for target in targets:
            benchmark_target(spec, target, outcomes, champions[target], store, force)
        outcomes = [_judge_and_track(spec, o, parent_run_id) for o in outcomes]
        outcomes = decide.decide(spec, outcomes, champions)
        deliveries: list[dict[str, Any]] = []
        try:
            outcomes = promote_task(spec, outcomes)
        except Exception as e:  # noqa: BLE001 - promotion rolled back: its candidates failed, the alias did not move
            for outcome in outcomes:
                if outcome.status == "passed":
                    _fail(outcome, "promote", e)
        else:
            deliveries = _after_promotion(spec, outcomes)
            events.announce_promotions(outcomes)
        for outcome in outcomes:
            if outcome.run_id:
                tracking.finish_candidate(outcome.run_id, spec, outcome)
            progress.candidate_done(outcome.candidate.name, outcome.status, [outcome.reason] if outcome.reason else [])
        tracking.describe_pipeline_run(parent_run_id, outcomes)
    _publish(pipeline, outcomes)
    return [o.summary() | {"events": _events_of(o, deliveries)} for o in outcomes]


def _events_of(outcome: CandidateOutcome, deliveries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """This run's deliveries of the events of the candidate's registry version (promotion or reconciliation)."""
    return [d for d in deliveries
            if outcome.model_name and (d["registered_model"], d["version"]) == (outcome.model_name,
                                                                                  outcome.model_version)]


def _publish(pipeline: str, outcomes: list[CandidateOutcome]) -> None:
    """A table of this run's candidates on the Prefect flow run page."""
    rows = [{"candidate": o.candidate.name, "status": o.status, "version": o.model_version or "",
             "throughput": round(o.metrics.get("throughput", float("nan")), 2),
             "p99_ms": round(o.metrics.get("p99_ms", float("nan")), 3),
             "speedup_vs_reference": round(o.metrics.get("speedup_vs_reference", float("nan")), 3),
             "reason": o.reason, "mlflow_run_id": o.run_id or ""}
            for o in outcomes]
    create_table_artifact(rows, key=f"{pipeline.replace('_', '-')}-candidates",
                          description=f"Candidates of pipeline {pipeline}: status, key metrics, gate reasons")


def _after_promotion(spec: PipelineSpec, outcomes: list[CandidateOutcome]) -> list[dict[str, Any]]:
    """Package and announce; returns the webhook deliveries. The alias has moved by now, so a failure here
    is reported on the promoted candidates without undoing their promotion; an unsent event stays
    pending for the next run or `smelter notify --retry`."""
    deliveries: list[dict[str, Any]] = []
    for stage, stage_task in (("package", package_task), ("notify", notify_task)):
        try:
            done = stage_task(spec, outcomes)
            if stage == "notify":
                deliveries = done
        except Exception as e:  # noqa: BLE001 - see the docstring
            progress.stage_failed("promotion", stage, f"{type(e).__name__}: {e}")
            for outcome in outcomes:
                if outcome.status == "promoted":
                    outcome.failed_stage = stage
                    outcome.error = f"{stage} failed after promotion: {type(e).__name__}: {e}"
    return deliveries


def _fail(outcome: CandidateOutcome, stage: str, error: Exception) -> None:
    progress.stage_failed(outcome.candidate.name, stage, "".join(traceback.format_exception_only(error)).strip())
    outcome.status = "failed"
    outcome.failed_stage = stage
    outcome.error = f"{stage} failed: {type(error).__name__}: {error}"
