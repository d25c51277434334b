"""Deployments: one set of names and schedules, whether served here or sent to work pools.

Every target maps to a work pool: its `pool:` when set, else `gpu-<arch>` for a GPU target and
`cpu` for the rest. The deployments:

- `smelter-nightly/nightly`: every pipeline, no schedule (ad hoc: `prefect deployment run`);
- `smelter-pipeline/<pipeline>`: one pipeline, on its `schedule:`;
- `smelter-build/<pool>` (on work pools only): builds and measures the targets of one pool for a
  pipeline run on another pool, which starts it (flows/fleet.py: fan-out and join).

`smelter deploy` serves the first two from one process, which builds every target itself.
`smelter deploy --pools` creates the pools and registers all of them for `prefect worker start
--pool <pool>`: the pipeline and nightly runs go to the parents' pool (`cpu`, or the file's first
pool when no target builds on cpu) and build its targets there; every other pool's targets go to
`smelter-build/<pool>`. `smelter deploy --prefect-yaml` writes the same for `prefect deploy --all`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import yaml

from tasks.config.spec import PipelinesFile, ScheduleSpec, TargetSpec

CPU_POOL = "cpu"
POOL_TYPE = "process"
TAG = "smelter"
BUILD_FLOW = "smelter-build"
FLOWS = {"smelter-nightly": "flows.nightly:nightly_flow", "smelter-pipeline": "flows.pipeline:pipeline_flow",
         BUILD_FLOW: "flows.pipeline:build_targets"}
PROJECT_STEP = "flows.worker_steps.project_directory"
ENTER_STEP = "flows.worker_steps.enter_project"


def pool_of(target: TargetSpec) -> str:
    """The work pool whose workers build this target."""
    explicit = getattr(target, "pool", None)
    if explicit:
        return explicit
    arch = target.gpu_arch
    return f"gpu-{arch}" if arch else CPU_POOL


def pools(specs: PipelinesFile) -> dict[str, list[str]]:
    """Each pool the file needs, with the targets it builds (`pipeline/target`); `cpu` first."""
    found: dict[str, list[str]] = {}
    for spec in specs.pipelines.values():
        for target in spec.targets:
            found.setdefault(pool_of(target), []).append(f"{spec.name}/{target.name}")
    return dict(sorted(found.items(), key=lambda item: (item[0] != CPU_POOL, item[0])))


@dataclass(frozen=True)
class DeploymentPlan:
    """One deployment, as `serve`, the Prefect API and prefect.yaml all describe it."""

    flow_name: str
    name: str
    pool: str
    parameters: dict[str, Any]
    description: str
    schedule: ScheduleSpec | None = None
    tags: list[str] = field(default_factory=list)

    @property
    def entrypoint(self) -> str:
        return FLOWS[self.flow_name]

    @property
    def full_name(self) -> str:
        return f"{self.flow_name}/{self.name}"


def parents_pool(specs: PipelinesFile) -> str:
    """Where pipeline and nightly runs go on a fleet: `cpu`, or the first pool when no target builds on cpu."""
    return next(iter(pools(specs)))


def plan(specs: PipelinesFile, file: str, artifacts: str, fan_out: bool = False) -> list[DeploymentPlan]:
    """Every deployment of a pipelines file; `file` and `artifacts` as the flows will see them.

    With `fan_out` (deployments for workers on pools), runs carry the pool they are on and each other
    pool gets its build deployment; without it (served from one process), every target builds there.
    """
    common = {"file": file, "artifacts": artifacts} | ({"allow_outside_paths": True} if specs.allow_outside_paths else {})
    home = parents_pool(specs)
    run = common | ({"pool": home} if fan_out else {})
    found = [DeploymentPlan("smelter-nightly", "nightly", home, run,
                            f"Every pipeline in {file}; run it ad hoc with "
                            f"`prefect deployment run 'smelter-nightly/nightly'`.", tags=[TAG])]
    for spec in specs.pipelines.values():
        if spec.schedule is not None:
            found.append(DeploymentPlan("smelter-pipeline", spec.name, home, run | {"pipeline": spec.name},
                                        f"Scheduled build of pipeline {spec.name}.", spec.schedule, [TAG, spec.name]))
    if fan_out:
        found += [DeploymentPlan(BUILD_FLOW, pool, pool, common,
                                 f"Builds and measures the targets of pool {pool} ({', '.join(targets)}) for a "
                                 f"pipeline run on pool {home}, which starts it.", tags=[TAG])
                  for pool, targets in pools(specs).items() if pool != home]
    return found


def _flow(flow_name: str) -> Any:
    from prefect.utilities.importtools import import_object

    return import_object(FLOWS[flow_name])


def _cron(schedule: ScheduleSpec) -> Any:
    from prefect.schedules import Cron

    return Cron(schedule.cron, timezone=schedule.timezone)


SILENT_RUNS_AUTOMATION = "smelter: crash flow runs whose process stopped sending heartbeats"
HEARTBEATS_MISSED = 3  # heartbeats a run may miss before the server calls it crashed


def crash_silent_runs() -> bool:
    """Make the lasting server mark a flow run `Crashed` once its process stops sending heartbeats (killed with
    -9, its host gone): nothing else ends it, so it would stay `Running` for ever and `prefect deployment run
    --watch` would wait on it. Prefect's own recipe (an automation on missed heartbeats); returns whether it was
    created now (the server already had it otherwise)."""
    return asyncio.run(_crash_silent_runs())


async def _crash_silent_runs() -> bool:
    from datetime import timedelta

    from prefect.automations import Automation
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import EventTrigger, Posture
    from prefect.events.schemas.events import ResourceSpecification
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY

    async with get_client() as client:
        if await client.read_automations_by_name(SILENT_RUNS_AUTOMATION):
            return False
    every = PREFECT_FLOWS_HEARTBEAT_FREQUENCY.value() or 180
    ended = {f"prefect.flow-run.{state}" for state in ("Completed", "Failed", "Cancelled", "Crashed")}
    await Automation(
        name=SILENT_RUNS_AUTOMATION,
        description=f"A flow run that sent a heartbeat, then none for {HEARTBEATS_MISSED} heartbeats ({every} s "
                    "apart: PREFECT_FLOWS_HEARTBEAT_FREQUENCY), did not end on its own: its process died.",
        trigger=EventTrigger(after={"prefect.flow-run.heartbeat"}, expect={"prefect.flow-run.heartbeat"} | ended,
                             match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
                             for_each={"prefect.resource.id"}, posture=Posture.Proactive, threshold=1,
                             within=timedelta(seconds=HEARTBEATS_MISSED * every)),
        actions=[ChangeFlowRunState(state=StateType.CRASHED, message="its process stopped sending heartbeats: "
                                    "killed, or its host gone")]).acreate()
    return True


def on_work_pools(plans: list[DeploymentPlan]) -> list[str]:
    """The deployments of `plans` that the server holds on a work pool (`smelter deploy --pools` registered them).
    Serving one would replace it under the same name with one that only this process runs, and the pool's
    workers, still sent its scheduled runs, could not start them."""
    return asyncio.run(_on_work_pools(plans))


async def _on_work_pools(plans: list[DeploymentPlan]) -> list[str]:
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    found = []
    async with get_client() as client:
        for p in plans:
            try:
                deployment = await client.read_deployment_by_name(p.full_name)
            except ObjectNotFound:
                continue
            if deployment.work_pool_name:
                found.append(f"{p.full_name} (pool {deployment.work_pool_name})")
    return found


def serve_schedules(plans: list[DeploymentPlan]) -> None:
    """Serve until interrupted; stopping leaves the schedules active for the next `serve`."""
    from prefect import serve

    serve(*[_flow(p.flow_name).to_deployment(
        name=p.name, parameters=p.parameters, description=p.description, tags=p.tags,
        schedules=[_cron(p.schedule)] if p.schedule else None) for p in plans], pause_on_shutdown=False)


def create_pools(names: list[str]) -> dict[str, bool]:
    """Create the work pools that do not exist yet (process type); returns {pool: created}."""
    return asyncio.run(_create_pools(names))


async def _create_pools(names: list[str]) -> dict[str, bool]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound
    from prefect.workers.process import ProcessWorker

    created = {}
    async with get_client() as client:
        for name in names:
            try:
                await client.read_work_pool(name)
                created[name] = False
                continue
            except ObjectNotFound:
                pass
            try:
                await client.create_work_pool(WorkPoolCreate(
                    name=name, type=POOL_TYPE, base_job_template=ProcessWorker.get_default_base_job_template(),
                    description=f"smelter: workers on hosts that build the {name} targets"))
                created[name] = True
            except ObjectAlreadyExists:
                created[name] = False
    return created


def register(plans: list[DeploymentPlan], project_dir: str) -> list[str]:
    """Register the deployments on their pools (upsert by name); workers run them from `project_dir`.

    Deployments smelter registered earlier that the file no longer has are removed, so a dropped
    schedule stops firing. Returns the full names registered.
    """
    return asyncio.run(_register(plans, project_dir))


async def _register(plans: list[DeploymentPlan], project_dir: str) -> list[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import DeploymentScheduleCreate
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterTags
    from prefect.client.schemas.schedules import CronSchedule
    from prefect.utilities.callables import parameter_schema

    pull_steps = [{ENTER_STEP: {"directory": project_dir}}]
    async with get_client() as client:
        for p in plans:
            flow = _flow(p.flow_name)
            flow_id = await client.create_flow_from_name(flow.name)
            schedules = [DeploymentScheduleCreate(schedule=CronSchedule(cron=p.schedule.cron,
                                                                        timezone=p.schedule.timezone),
                                                  active=True)] if p.schedule else []
            await client.create_deployment(
                flow_id=flow_id, name=p.name, work_pool_name=p.pool, entrypoint=p.entrypoint,
                parameters=p.parameters, description=p.description, tags=p.tags, schedules=schedules,
                pull_steps=pull_steps, parameter_openapi_schema=parameter_schema(flow).model_dump(),
                paused=False)
        wanted = {p.full_name for p in plans}
        ours = await client.read_deployments(deployment_filter=DeploymentFilter(tags=DeploymentFilterTags(all_=[TAG])))
        flow_names = {f.id: f.name for f in await client.read_flows()}
        for deployment in ours:
            name = f"{flow_names.get(deployment.flow_id)}/{deployment.name}"
            if flow_names.get(deployment.flow_id) in FLOWS and name not in wanted:
                await client.delete_deployment(deployment.id)
    return sorted(wanted)


def prefect_yaml(plans: list[DeploymentPlan], source: str) -> str:
    """The same deployments as a prefect.yaml for `prefect deploy --all`, generated from `source`."""
    document = {
        "name": "smelter",
        "prefect-version": "3.9.1",
        "build": [{PROJECT_STEP: {"id": "project"}}],
        "pull": [{ENTER_STEP: {"directory": "{{ project.directory }}"}}],
        "deployments": [_yaml_entry(p) for p in plans],
    }
    header = (f"# Generated by `smelter deploy --prefect-yaml` from {source}; do not edit by hand.\n"
              "# `smelter deploy --pools` creates the work pools first, then `prefect deploy --all` registers\n"
              "# these deployments from the directory workers run them in (the build step records it).\n")
    return header + yaml.safe_dump(document, sort_keys=False, width=120)


def _yaml_entry(p: DeploymentPlan) -> dict[str, Any]:
    entry: dict[str, Any] = {"name": p.name, "description": p.description, "entrypoint": p.entrypoint,
                             "parameters": p.parameters, "tags": p.tags}
    # `schedules: null` when unscheduled: `[]` makes `prefect deploy` warn (FutureWarning) and a missing key
    # makes it ask for a schedule
    entry["schedules"] = [{"cron": p.schedule.cron, "timezone": p.schedule.timezone}] if p.schedule else None
    entry["work_pool"] = {"name": p.pool}
    return entry
