"""One model's graph: export → validate → precision[p] → build[p, target] → accuracy → benchmark → gate → decide → promote → notify.

Two flows. `build_targets` (build half: every stage up to the target's benchmark, each candidate
logged to MLflow) runs wherever the targets' pool is; `pipeline_flow` (judge half) runs the builds,
in-process for its own pool and through flows/fleet.py for the others, reads the candidates back
from MLflow, then gates, decides, promotes and notifies. Orchestration only. A stage that fails
marks the candidates downstream of it `failed` and the others carry on; nothing here decides what
a stage computes.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from prefect import flow, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.states import Completed, Failed, State

from flows import events, fleet, prefect_outcome, progress
from flows.stages import run_step
from tasks import graph
from tasks.config.settings import FigureSettings, RegistrySettings, RunSettings
from tasks.config.spec import Candidate, PipelineSpec, PipelinesFile, load, point_words
from tasks.judge import notify, summary_figure
from tasks.judge.steps import Judging
from tasks.outcome import CandidateOutcome, Champion, pending_events, tally
from tasks.registry import tracking
from tasks.runtime import scratch
from tasks.runtime.error_text import described
from tasks.runtime.store import TOOL_CACHES, ArtifactStore, StageResult
from tasks.stages import benchmark, engine_check
from tasks.stages.champion import champion_build


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
                progress.stage_failed(node, stage, described(e))
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
        outcome.error = f"{failed.stage} failed: {described(failed.error)}"
    return outcome


def benchmark_target(spec: PipelineSpec, target: str, outcomes: list[CandidateOutcome], champion: Champion | None,
                     store: ArtifactStore, force: bool) -> None:
    """Time every built candidate of one target side by side with the reference and the champion."""
    built = [o for o in outcomes if o.candidate.target == target and o.status != "failed"]
    if not built:
        return
    fetch = functools.partial(champion_build, spec.name, champion, store) if champion else None
    step = graph.benchmark_step(spec, target, [o.candidate.name for o in built], champion, fetch)
    try:
        result = _unwrap(run_step(step, {("build", o.candidate.name): o.stages["build"] for o in built}, store, force))
    except Exception as e:  # noqa: BLE001 - the target's candidates fail; other targets go on
        progress.stage_failed(step.node, "benchmark", described(e))
        for outcome in built:
            outcome.status, outcome.failed_stage = "failed", "benchmark"
            outcome.error = f"benchmark failed: {described(e)}"
        return
    for outcome in built:
        outcome.stages["benchmark"] = benchmark.for_candidate(result, outcome.candidate.name, champion)


@task(name="track", cache_policy=NO_CACHE, persist_result=False)
def track_task(parent_run_id: str, record: RunSettings, outcome: CandidateOutcome, where: dict[str, str]) -> str:
    return tracking.log_candidate(parent_run_id, record, outcome, extra_tags=where)


def _check_engine_here(record: RunSettings, outcome: CandidateOutcome, run_id: str) -> None:
    """Check the engine on the host that built it (the parent may have no copy, or no GPU to load it on);
    the parent trusts this verdict for engines it cannot check itself."""
    if outcome.status == "failed":
        return
    try:
        engine_check.check_before_registering(record.targets, record.profiles, outcome.stages,
                                              tracking.uploaded_engine_digest(run_id))
    except engine_check.EngineRejected as e:
        tracking.record_engine_check(run_id, str(e))
    else:
        tracking.record_engine_check(run_id, "passed")


@task(name="verdict", cache_policy=NO_CACHE, persist_result=False, retries=0)
def verdict_task(outcome: CandidateOutcome) -> State:
    """The candidate's last task, named after it, in a state whose colour says what happened
    (flows/prefect_outcome.py): a green `Completed` for a rejected engine would hide what a reader wants."""
    progress.candidate_done(outcome.candidate.name, outcome.status, [outcome.reason] if outcome.reason else [])
    return prefect_outcome.verdict_state(outcome)


@flow(name="smelter-build", flow_run_name="{pipeline}-build")
def build_targets(file: str, pipeline: str, targets: list[str], parent_run_id: str,
                  precisions: list[str] | None = None, force: bool = False, artifacts: str = "artifacts",
                  allow_outside_paths: bool = False) -> dict[str, str]:
    """Build and measure the candidates of `targets` on this host, each logged as a child run of
    `parent_run_id` (the parent reads everything from MLflow); returns why the candidates whose run could
    not be logged have none ({candidate: reason}), for a parent in this process to say so."""
    spec = load(file, pipelines=[pipeline], allow_outside_paths=allow_outside_paths).pipelines[pipeline]
    candidates = spec.candidates(precisions, targets)
    store = ArtifactStore(artifacts)
    scratch.activate()  # library temp files in a dir of this process's, a dead run's removed
    _quiet_libraries()
    store.clean(pipeline)
    memo = _Memo()
    registry, record = RegistrySettings.of(spec), RunSettings.of(spec)
    where = fleet.placement_tags()
    outcomes, gpus = [], {}
    for on_gpu in (False, True):
        group = [t for t in targets if (spec.target(t).device_kind == "gpu") == on_gpu]
        if not group:
            continue
        with fleet.gpu_slot(on_gpu) as gpu:
            built = [build_candidate(spec, c, store, memo, force) for c in candidates if c.target in group]
            for target in group:
                benchmark_target(spec, target, built, tracking.champion(registry, target), store, force)
        outcomes += built
        gpus |= {t: gpu for t in group if gpu is not None}
    untracked = {}
    for outcome in outcomes:
        gpu = gpus.get(outcome.candidate.target)
        try:
            run_id = track_task.with_options(task_run_name=f"{outcome.candidate.name}/track")(
                parent_run_id, record, outcome, where | ({"fleet.gpu": gpu} if gpu else {}))
            _check_engine_here(record, outcome, run_id)
        except Exception as e:  # noqa: BLE001 - the parent finds no run for it and fails it; the others go on
            untracked[outcome.candidate.name] = f"its MLflow run could not be logged: {described(e)}"
            progress.stage_failed(outcome.candidate.name, "track", described(e))
    return untracked


@task(name="build-on-pool", cache_policy=NO_CACHE, persist_result=False)
def build_on_pool_task(pool: str, parameters: dict[str, Any], worker_timeout: float) -> fleet.PoolRun:
    return fleet.dispatch(pool, parameters, worker_timeout)


def _build_everywhere(specs: PipelinesFile, spec: PipelineSpec, targets: list[str], parent_run_id: str,
                      build_parameters: dict[str, Any], here: str | None) -> dict[str, str]:
    """Run every target's builds, this pool's in-process and the others' on their pools at the same time;
    returns why the targets whose build did not complete, and the candidates whose run was not logged, have no
    outcome ({target or candidate: reason})."""
    local, remote = fleet.split_by_pool([spec.target(t) for t in targets], here)
    futures = {pool: build_on_pool_task.with_options(task_run_name=f"{spec.name}@{pool}").submit(
        pool, build_parameters | {"targets": pool_targets, "parent_run_id": parent_run_id},
        specs.fleet.worker_timeout) for pool, pool_targets in remote.items()}
    missing: dict[str, str] = {}
    if local:
        try:
            missing |= build_targets(**build_parameters, targets=local, parent_run_id=parent_run_id)
        except Exception as e:  # noqa: BLE001 - the local targets fail; the other pools' builds go on
            missing |= {t: f"build failed: {described(e)}" for t in local}
    for pool, future in futures.items():
        try:
            ran = future.result()
        except Exception as e:  # noqa: BLE001 - this pool's targets fail; the rest of the run goes on
            ran = fleet.PoolRun(pool, None, f"build on pool {pool} failed: {described(e)}")
        missing |= {t: ran.failure or f"build on pool {pool} (flow run {ran.flow_run_id}) logged no MLflow run"
                    for t in remote[pool]}
    return missing


def _joined(pipeline: str, candidates: list[Candidate], parent_run_id: str, store: ArtifactStore,
            missing: dict[str, str]) -> list[CandidateOutcome]:
    """Every candidate as its build logged it in MLflow; one with no run failed, with the reason."""
    logged = tracking.candidate_outcomes(pipeline, parent_run_id, store.root)
    outcomes = []
    for candidate in candidates:
        outcome = logged.get(candidate.name)
        if outcome is None and candidate.name in missing:  # built, its run not logged: said where it failed
            outcome = CandidateOutcome(candidate, "failed", error=missing[candidate.name], failed_stage="track")
        elif outcome is None:
            why = missing.get(candidate.target, "its build logged no MLflow run (see the flow run's logs)")
            outcome = CandidateOutcome(candidate, "failed", error=why, failed_stage="build")
            progress.stage_failed(candidate.name, "build", why)
        outcomes.append(outcome)
    return outcomes


@flow(name="smelter-pipeline", flow_run_name="{pipeline}")
def pipeline_flow(file: str, pipeline: str, precisions: list[str] | None = None, targets: list[str] | None = None,
                  force: bool = False, artifacts: str = "artifacts", allow_outside_paths: bool = False,
                  pool: str | None = None) -> State:
    """Build, judge, record and promote every selected candidate of one pipeline; the flow run ends with
    the count of each outcome as its message and one summary per candidate as its result (`flow_end`).

    `pool` is the work pool this run is on: its targets build here, every other pool's on that pool
    (`smelter-build/<pool>`). Without one (`smelter run`, `smelter deploy`), every target builds here.
    """
    specs = load(file, pipelines=[pipeline], allow_outside_paths=allow_outside_paths)
    spec = specs.pipelines[pipeline]
    candidates = spec.candidates(precisions, targets)
    store = ArtifactStore(artifacts)
    scratch.activate()
    _quiet_libraries()
    run_name = f"{pipeline}-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}"
    params = {"file": file, "force": force, "gate_point": point_words(spec.gate_point)}
    with tracking.pipeline_run(spec, run_name, params=params) as parent_run_id:
        chosen = list(dict.fromkeys(c.target for c in candidates))
        registry = RegistrySettings.of(spec)
        champions = {t: tracking.champion(registry, t) for t in chosen}
        build_parameters = {"file": file, "pipeline": pipeline, "precisions": precisions, "force": force,
                            "artifacts": artifacts, "allow_outside_paths": allow_outside_paths}
        missing = _build_everywhere(specs, spec, chosen, parent_run_id, build_parameters, pool)
        judged = Judging(spec, _joined(spec.name, candidates, parent_run_id, store, missing), champions)
        for step in graph.judge_steps(spec, candidates):
            judged = _judge(step, judged)
        events.announce_promotions(judged.outcomes)
        outcomes, deliveries = judged.outcomes, judged.deliveries
        figure = _summary_figure(FigureSettings.of(spec), outcomes, parent_run_id,
                                 store.root / TOOL_CACHES / summary_figure.DRAWN)
        record = RunSettings.of(spec)
        for outcome in outcomes:
            if outcome.run_id:
                tracking.finish_candidate(outcome.run_id, record, outcome, figure)
            verdict_task.with_options(task_run_name=outcome.candidate.name)(outcome, return_state=True)
        tracking.describe_pipeline_run(parent_run_id, outcomes)
        _show_outboxes(outcomes, deliveries)
    _publish(pipeline, outcomes)
    counts = tally(o.status for o in outcomes)
    progress.message(f"{pipeline}: {counts}")
    return flow_end(counts, [o.summary() | {"events": _events_of(o, deliveries), "mlflow_parent_run_id": parent_run_id}
                             for o in outcomes])


def _judge(step: graph.Step, judged: Judging) -> Judging:
    """Run one judging step of the graph as a Prefect task named after its stage, unless a step it reads
    failed; the line of each failure it records goes to the terminal."""
    if judged.failed.intersection(step.needs):
        return dataclasses.replace(judged, failed=judged.failed | {step.ref})
    errors = {o.candidate.name: o.error for o in judged.outcomes}
    act = task(step.judge, name=step.stage, cache_policy=NO_CACHE, persist_result=False)
    judged = act.with_options(task_run_name=f"{step.node}/{step.stage}")(judged, step.node)
    said = set()
    for outcome in judged.outcomes:
        if outcome.error and outcome.error != errors.get(outcome.candidate.name):
            label = outcome.candidate.name if outcome.status == "failed" else "promotion"  # after it: one line
            line = (label, outcome.failed_stage or step.stage, outcome.error.partition(": ")[2])
            if line not in said:
                said.add(line)
                progress.stage_failed(*line)
    return judged


def flow_end(counts: str, summaries: list[dict[str, Any]]) -> State:
    """A pipeline or nightly flow run's final state: `Failed` when a candidate failed (a stage broke), as
    `smelter run`'s exit code says, so that the Prefect UI, its automations on failed runs and
    `prefect deployment run --watch` see it; `Completed` otherwise. The summaries are its result either way."""
    failed = any(s["status"] == "failed" for s in summaries)
    prefect_outcome.name_flow_run(s["status"] for s in summaries)
    if pending := len(pending_events(summaries)):  # a webhook that did not answer: said where the run's end is read
        counts += f"; {pending} webhook deliver{'y' if pending == 1 else 'ies'} pending (smelter notify --retry)"
    return (Failed if failed else Completed)(message=counts, data=summaries)


def flow_summaries(state: State) -> list[dict[str, Any]]:
    """The summaries a flow run called with `return_state=True` ended with, Failed or not; an error raised
    inside it is raised again here."""
    summaries = state.result(raise_on_failure=False)
    if isinstance(summaries, BaseException):
        raise summaries
    return summaries


def _summary_figure(settings: FigureSettings, outcomes: list[CandidateOutcome], parent_run_id: str,
                    drawn: Path) -> bytes | None:
    """The run's summary figure, logged on the parent run; None (and a warning) when it cannot be drawn:
    a picture never fails a run."""
    try:
        figure = summary_figure.summary_png(settings, outcomes, drawn)
        tracking.log_summary_figure(parent_run_id, figure)
    except Exception as e:  # noqa: BLE001 - see the docstring
        progress.message(f"warning: {settings.pipeline}: no summary figure: {type(e).__name__}: {e}")
        return None
    return figure


def _show_outboxes(outcomes: list[CandidateOutcome], deliveries: list[dict[str, Any]]) -> None:
    """A readable outbox on every version this run registered or delivered events of."""
    versions = [(o.model_name, o.model_version) for o in outcomes if o.model_name and o.model_version]
    versions += [(d["registered_model"], d["version"]) for d in deliveries]
    for warning in notify.show_outboxes(versions):
        progress.message(warning)


def _quiet_libraries() -> None:
    """No progress bars or MLflow run links between the stage lines: on a worker they interleave with
    them, and smelter names the runs itself (the CLI's last lines, the Prefect table)."""
    os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")


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
             "reason": o.reason, "mlflow_run_id": o.run_id or "", "mlflow_run": _run_link(o.run_id)}
            for o in outcomes]
    create_table_artifact(rows, key=f"{pipeline.replace('_', '-')}-candidates",
                          description=f"Candidates of pipeline {pipeline}: status, key metrics, gate reasons")


def _run_link(run_id: str | None) -> str:
    """The run in the MLflow UI, so a reader of the Prefect table can open it; empty when MLflow cannot say."""
    if not run_id:
        return ""
    try:
        return tracking.run_url(run_id)
    except Exception:  # noqa: BLE001 - a link is a convenience; the run id is in the row
        return ""
