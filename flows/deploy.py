"""Deployments: one scheduled deployment per pipeline with a `schedule:`, and an ad-hoc nightly one.

`smelter deploy` serves them from this process (Prefect's `serve`); `prefect deploy --all` with
prefect.yaml sends the same flows to work pools instead. Either way a user triggers an ad-hoc
build with `prefect deployment run 'smelter-nightly/nightly'`.
"""

from __future__ import annotations

from typing import Any

from prefect import serve
from prefect.schedules import Cron

from flows.nightly import nightly_flow
from flows.pipeline import pipeline_flow
from tasks.spec import PipelinesFile


def deployments(specs: PipelinesFile, file: str, artifacts: str) -> list[Any]:
    """The RunnerDeployments for a pipelines file, schedules taken from each pipeline."""
    paths = {"allow_outside_paths": True} if specs.allow_outside_paths else {}
    found = [nightly_flow.to_deployment(
        name="nightly", parameters={"file": file, "artifacts": artifacts, **paths},
        description="Every pipeline in the pipelines file; trigger ad hoc with `prefect deployment run`.")]
    for spec in specs.pipelines.values():
        if spec.schedule is None:
            continue
        found.append(pipeline_flow.to_deployment(
            name=spec.name, parameters={"file": file, "pipeline": spec.name, "artifacts": artifacts, **paths},
            schedules=[Cron(spec.schedule.cron, timezone=spec.schedule.timezone)],
            tags=["smelter", spec.name], description=f"Nightly build of pipeline {spec.name}"))
    return found


def serve_schedules(specs: PipelinesFile, file: str, artifacts: str) -> None:
    """Serve until interrupted; stopping leaves the schedules active for the next `serve`."""
    serve(*deployments(specs, file, artifacts), pause_on_shutdown=False)
