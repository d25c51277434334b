"""Deployments: one set of names and schedules, whether served here or sent to work pools.

Every target maps to a work pool: its `pool:` when set, else `gpu-<arch>` for a GPU target and
`cpu` for the rest. A deployment runs the targets of one pool:

- `smelter-nightly/nightly`: every pipeline, no schedule (ad hoc: `prefect deployment run`);
- `smelter-pipeline/<pipeline>`: one pipeline, on its `schedule:`.

When a file's targets span several pools, each of these is split into one deployment per pool,
named `<name>-<pool>` and limited to that pool's targets (the nightly one by its `pool` parameter,
a pipeline's by its `targets`), so every engine is built on a host of its kind. `smelter deploy` serves them from one process; `smelter deploy --pools` creates the
pools and registers the same deployments there for `prefect worker start --pool <pool>`;
`smelter deploy --prefect-yaml` writes them out for `prefect deploy --all`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import yaml

from tasks.spec import PipelinesFile, ScheduleSpec, TargetSpec

CPU_POOL = "cpu"
POOL_TYPE = "process"
TAG = "smelter"
FLOWS = {"smelter-nightly": "flows.nightly:nightly_flow", "smelter-pipeline": "flows.pipeline:pipeline_flow"}
PROJECT_STEP = "flows.worker_steps.project_directory"
ENTER_STEP = "flows.worker_steps.enter_project"


def pool_of(target: TargetSpec) -> str:
    """The work pool whose workers build this target."""
    explicit = getattr(target, "pool", None)
    if explicit:
        return explicit
    arch = getattr(target, "arch", None)
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


def _per_pool(targets_by_pool: dict[str, list[str]], name: str) -> list[tuple[str, str, list[str] | None]]:
    """(deployment name, pool, targets) for one deployment, split per pool when it spans several."""
    if len(targets_by_pool) == 1:
        return [(name, next(iter(targets_by_pool)), None)]
    return [(f"{name}-{pool}", pool, sorted(set(targets))) for pool, targets in targets_by_pool.items()]


def plan(specs: PipelinesFile, file: str, artifacts: str) -> list[DeploymentPlan]:
    """Every deployment of a pipelines file; `file` and `artifacts` as the flows will see them."""
    common = {"file": file, "artifacts": artifacts} | ({"allow_outside_paths": True} if specs.allow_outside_paths else {})
    found = [DeploymentPlan("smelter-nightly", name, pool, common | ({"pool": pool} if targets else {}),
                            f"Every pipeline in {file}{_on(pool, targets)}; run it ad hoc with "
                            f"`prefect deployment run 'smelter-nightly/{name}'`.", tags=[TAG])
             for name, pool, targets in _per_pool(pools(specs), "nightly")]
    for spec in specs.pipelines.values():
        if spec.schedule is None:
            continue
        by_pool: dict[str, list[str]] = {}
        for target in spec.targets:
            by_pool.setdefault(pool_of(target), []).append(target.name)
        by_pool = dict(sorted(by_pool.items(), key=lambda item: (item[0] != CPU_POOL, item[0])))
        for name, pool, targets in _per_pool(by_pool, spec.name):
            parameters = common | {"pipeline": spec.name} | ({"targets": targets} if targets else {})
            found.append(DeploymentPlan("smelter-pipeline", name, pool, parameters,
                                        f"Scheduled build of pipeline {spec.name}{_on(pool, targets)}.",
                                        spec.schedule, [TAG, spec.name]))
    return found


def _on(pool: str, targets: list[str] | None) -> str:
    return f", targets {', '.join(targets)} on pool {pool}" if targets else f", on pool {pool}"


def _flow(flow_name: str) -> Any:
    from prefect.utilities.importtools import import_object

    return import_object(FLOWS[flow_name])


def _cron(schedule: ScheduleSpec) -> Any:
    from prefect.schedules import Cron

    return Cron(schedule.cron, timezone=schedule.timezone)


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
    entry["schedules"] = [{"cron": p.schedule.cron, "timezone": p.schedule.timezone}] if p.schedule else []
    entry["work_pool"] = {"name": p.pool}
    return entry
