"""Every pipeline in pipelines.yaml, one subflow each: what the nightly schedule and `smelter run` start."""

from __future__ import annotations

from typing import Any

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from flows.pipeline import pipeline_flow
from tasks import notify
from tasks.spec import load


@task(name="retry-pending-webhooks", cache_policy=NO_CACHE, persist_result=False)
def retry_pending_task(file: str) -> list[dict[str, Any]]:
    """Deliver events a receiver missed on an earlier run before new ones go out."""
    return notify.retry_pending(list(load(file).pipelines.values()))


@flow(name="smelter-nightly", flow_run_name="nightly")
def nightly_flow(file: str = "pipelines.yaml", pipelines: list[str] | None = None,
                 precisions: list[str] | None = None, targets: list[str] | None = None,
                 force: bool = False, artifacts: str = "artifacts") -> list[dict[str, Any]]:
    """Build every selected candidate of every selected pipeline; returns one summary per candidate."""
    specs = load(file)
    retry_pending_task(file)
    summaries: list[dict[str, Any]] = []
    for name in pipelines or list(specs.pipelines):
        summaries += pipeline_flow(file, name, precisions=precisions, targets=targets, force=force,
                                   artifacts=artifacts)
    return summaries
