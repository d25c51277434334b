"""Fan-out and join across work pools: what a run sends to other hosts and how it gets it back.

A pipeline run (the parent) builds its own pool's targets in-process and sends every other pool's
targets to that pool's build deployment, `smelter-build/<pool>`, with `run_deployment`. A build logs
each candidate as a child MLflow run of the parent's run; the parent joins by reading those runs back
(`tracking.candidate_outcomes`), never by unpickling what another process returned. A pool whose
flow run no worker picks up within `fleet.worker_timeout` is cancelled and its candidates fail with
that reason; the other pools go on.

On a GPU host, a build holds a Prefect global concurrency limit `gpu:<host>:<index>` (limit 1,
nvidia-smi's index) for the GPU it uses and sees only that GPU, so two builds never share one,
whatever the worker's limit.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from flows.deploy import BUILD_FLOW, pool_of
from tasks.config.spec import TargetSpec
from tasks.runtime import gpu, locks

POLL_S = 2.0
GPU_SLOT_RETRY_S = 5.0
GPU_LIMIT_PREFIX = "gpu"
WORKER_NAME_ENV = "PREFECT__WORKER_NAME"  # set by a Prefect worker in the flow-run processes it starts


def split_by_pool(targets: Sequence[TargetSpec], here: str | None) -> tuple[list[str], dict[str, list[str]]]:
    """(names of the targets built here, {other pool: its targets' names}). With no pool given, everything builds
    here."""
    remote: dict[str, list[str]] = {}
    local = []
    for target in targets:
        pool = pool_of(target)
        if here is None or pool == here:
            local.append(target.name)
        else:
            remote.setdefault(pool, []).append(target.name)
    return local, remote


def build_deployment(pool: str) -> str:
    return f"{BUILD_FLOW}/{pool}"


@dataclass(frozen=True)
class PoolRun:
    """How one pool's build flow run ended, as the parent saw it. `failure` is None when it completed."""

    pool: str
    flow_run_id: str | None
    failure: str | None = None


def dispatch(pool: str, parameters: dict[str, Any], worker_timeout: float) -> PoolRun:
    """Start the pool's build and wait for it; cancel it if no worker picks it up within `worker_timeout` s."""
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment
    from prefect.exceptions import ObjectNotFound
    from prefect.states import Cancelled

    name = build_deployment(pool)
    try:
        started = run_deployment(name, parameters=parameters, timeout=0)
    except ObjectNotFound:
        return PoolRun(pool, None, f"no deployment {name}: register it with `smelter deploy --pools`")
    deadline = time.monotonic() + worker_timeout
    with get_client(sync_client=True) as client:
        while True:
            run = client.read_flow_run(started.id)
            state = run.state
            if state is not None and state.is_final():
                failure = None if state.is_completed() else (
                    f"build on pool {pool} ended {state.name}: {state.message or 'see flow run ' + str(run.id)}")
                return PoolRun(pool, str(run.id), failure)
            waiting = state is None or state.is_scheduled()
            if waiting and time.monotonic() > deadline:
                reason = f"no worker on pool {pool} within {worker_timeout:g} s"
                result = client.set_flow_run_state(run.id, Cancelled(message=reason))
                if result.state is not None and result.state.is_cancelled():
                    return PoolRun(pool, str(run.id), reason)
                # a worker took it just now: keep waiting for the build
            time.sleep(POLL_S)


def placement_tags() -> dict[str, str]:
    """Where a candidate was built, as tags on its MLflow run: the host, the worker, and the work pool and
    flow run that worker took (for a build run in-process, the run it is nested in)."""
    from prefect.runtime import flow_run

    tags = {"fleet.host": socket.gethostname()}
    if worker := os.environ.get(WORKER_NAME_ENV):
        tags["fleet.worker"] = worker
    if run_id := flow_run.get_id():
        taken_id, pool = _taken_run(str(run_id))
        tags["fleet.flow_run_id"] = taken_id
        if pool:
            tags["fleet.pool"] = pool
    return tags


def _taken_run(flow_run_id: str) -> tuple[str, str | None]:
    """(flow run id, work pool) of the run a worker took: this one, or the one it is nested in."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        run = client.read_flow_run(flow_run_id)
        while run.work_pool_name is None and run.parent_task_run_id is not None:
            run = client.read_flow_run(client.read_task_run(run.parent_task_run_id).flow_run_id)
        return str(run.id), run.work_pool_name


def host_gpus() -> list[tuple[str, str]]:
    """(nvidia-smi index, UUID) of each GPU this process may use (see `usable_gpus`); none without nvidia-smi."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    listed = gpu.parse_smi_rows(subprocess.run([smi, f"--query-gpu={gpu.SMI_FIELDS}", "--format=csv,noheader,nounits"],
                                               capture_output=True, text=True, timeout=30, check=True).stdout)
    return usable_gpus(listed, os.environ.get("CUDA_VISIBLE_DEVICES"), os.environ.get("CUDA_DEVICE_ORDER"))


def usable_gpus(listed: list[gpu.GpuInfo], visible: str | None, order: str | None) -> list[tuple[str, str]]:
    """The GPUs CUDA would give this process, in its order, each as (nvidia-smi index, UUID).

    nvidia-smi's index names a GPU the same way in every process of the host, whatever each one's
    CUDA_VISIBLE_DEVICES says, so it is what the per-GPU limits are named by.
    """
    physical = {g.uuid: str(g.index) for g in listed}
    return [(physical[g.uuid], g.uuid) for g in gpu.apply_visible(gpu.cuda_order(listed, order), visible)]


def gpu_limit_name(host: str, index: str) -> str:
    return f"{GPU_LIMIT_PREFIX}:{host}:{index}"


@contextlib.contextmanager
def gpu_slot(needed: bool, gpus: list[tuple[str, str]] | None = None) -> Iterator[str | None]:
    """Hold one of this host's GPUs for the block (yields its nvidia-smi index; None when no GPU is needed
    or there is none).

    Each GPU has its own global concurrency limit of 1, created on first use; the block waits until
    one is free, then sees only that GPU (CUDA_VISIBLE_DEVICES set to its UUID before any CUDA call of
    this flow-run process), so two builds never share one. `gpus` as `host_gpus` returns them.
    """
    if not needed:
        yield None
        return
    gpus = host_gpus() if gpus is None else gpus
    if not gpus:  # nothing to share; the GPU stages fail for want of a GPU, each with its backend's reason
        yield None
        return
    host = socket.gethostname()
    while True:
        for index, uuid in gpus:
            held = contextlib.ExitStack()
            try:
                held.enter_context(locks.held_slot(gpu_limit_name(host, index), f"GPU {index} of {host}", wait=False))
            except locks.SlotBusy:
                continue
            with held, _only_gpu(uuid):
                yield index
            return
        time.sleep(GPU_SLOT_RETRY_S)


@contextlib.contextmanager
def _only_gpu(uuid: str) -> Iterator[None]:
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = uuid
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before
