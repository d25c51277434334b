"""Every pipeline in pipelines.yaml, one subflow each: what the nightly schedule and `smelter run` start."""

from __future__ import annotations

from typing import Any

from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from prefect.states import State

from flows import progress
from flows.pipeline import flow_end, flow_summaries, pipeline_flow
from tasks.config.settings import RegistrySettings
from tasks.config.spec import PipelineSpec, load
from tasks.judge import notify
from tasks.outcome import CandidateOutcome, tally


@task(name="retry-pending-webhooks", task_run_name="retry-pending-webhooks", cache_policy=NO_CACHE,
      persist_result=False)
def retry_pending_task(file: str, pipelines: list[str] | None = None,
                       allow_outside_paths: bool = False) -> list[dict[str, Any]]:
    """Deliver events a receiver missed on an earlier run before new ones go out."""
    specs = load(file, pipelines=pipelines, allow_outside_paths=allow_outside_paths)
    return notify.retry_pending([RegistrySettings.of(spec) for spec in specs.pipelines.values()])


def _failed_pipeline(spec: PipelineSpec, precisions: list[str] | None, targets: list[str] | None,
                     error: Exception) -> list[dict[str, Any]]:
    """What a pipeline that crashed outside its stages reports: each selected candidate failed, with why."""
    message = f"pipeline {spec.name} failed: {type(error).__name__}: {error}"
    return [CandidateOutcome(c, "failed", error=message, failed_stage="pipeline").summary()
            for c in spec.candidates(precisions, targets)]


@flow(name="smelter-nightly", flow_run_name="nightly")
def nightly_flow(file: str = "pipelines.yaml", pipelines: list[str] | None = None,
                 precisions: list[str] | None = None, targets: list[str] | None = None,
                 force: bool = False, artifacts: str = "artifacts", allow_outside_paths: bool = False,
                 pool: str | None = None) -> State:
    """Build every selected candidate of every selected pipeline; ends with the count of each outcome as
    the flow run's message and one summary per candidate as its result.

    `pool` is the work pool this run is on: other pools' targets are sent to their build deployments
    (see `pipeline_flow`); without one, every target builds here."""
    specs = load(file, pipelines=pipelines, allow_outside_paths=allow_outside_paths)
    try:
        retry_pending_task(file, pipelines, allow_outside_paths)
    except Exception as e:  # noqa: BLE001 - old events stay pending; tonight's builds still run
        progress.message(f"warning: retrying pending webhook events failed: {type(e).__name__}: {e}")
    summaries: list[dict[str, Any]] = []
    for name in pipelines or list(specs.pipelines):
        if not specs.pipelines[name].candidates(precisions, targets):
            continue
        try:
            ended = flow_summaries(pipeline_flow(file, name, precisions=precisions, targets=targets, force=force,
                                                 artifacts=artifacts, allow_outside_paths=allow_outside_paths,
                                                 pool=pool, return_state=True))
        except Exception as e:  # noqa: BLE001 - one broken pipeline does not stop the others, a lost server does
            progress.stop_if_a_server_was_lost(e)
            ended = _failed_pipeline(specs.pipelines[name], precisions, targets, e)
        else:
            if any(s["status"] == "failed" for s in ended):  # this pipeline's failures, each asked about once
                progress.stop_if_a_server_was_lost()
        summaries += ended
    return flow_end(tally(s["status"] for s in summaries), summaries)
