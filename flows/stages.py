"""Prefect tasks over the stage runner; the only place stages meet Prefect.

Stages cache in the artifact store (content-addressed and hash-verified, so a hit whose directory
is gone or damaged simply rebuilds). A hit returns Prefect's `Cached` state so the UI shows it as
such; Prefect's own result cache stays off because it cannot know the artifact directory is still
intact. Producing one key is guarded by a Prefect global concurrency limit named from the key (so
two runs, also on two hosts, build it once), inside which the store's file lock guards this host.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.states import Completed

from flows import progress
from tasks.graph import Step, call_work
from tasks.stage import run_stage, shared_key_lock
from tasks.store import ArtifactStore, StageResult

LEASE_S = 60  # Prefect renews it while the holder lives; a killed holder blocks the key at most this long


def limit_name(key_name: str) -> str:
    return f"smelter-build-{key_name}"


@contextlib.contextmanager
def global_key_lock(key_name: str) -> Iterator[None]:
    """One holder at a time for this key across every run talking to this Prefect API.

    Prefect does not create a limit on first use (a missing one is skipped with a warning), so it
    is created here with one slot; `strict` then refuses to go on without it.
    """
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.concurrency.sync import concurrency
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    name = limit_name(key_name)
    with get_client(sync_client=True) as client:
        try:
            client.read_global_concurrency_limit_by_name(name)
        except ObjectNotFound:
            with contextlib.suppress(ObjectAlreadyExists):  # another run created it meanwhile
                client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))
    with concurrency(name, occupy=1, strict=True, lease_duration=LEASE_S):
        yield


def _as_state(label: str, stage: str, result: StageResult) -> Any:
    if result.repaired:
        progress.message(f"warning: {label} {stage}: {result.repaired}")
    progress.stage_done(label, stage, cached=result.cached, kept=result.kept)
    if result.kept:
        return Completed(data=result, name="Kept", message=f"artifact {result.key} kept: {result.kept}")
    if result.cached:
        return Completed(data=result, name="Cached", message=f"artifact {result.key} already built")
    return result


@functools.cache
def stage_task(stage: str) -> Any:
    """The Prefect task that runs one stage's steps (named after the stage in the UI)."""

    @task(name=stage, cache_policy=NO_CACHE, persist_result=False)
    def stage_step(step: Step, inputs: dict[tuple[str, str], StageResult], store: ArtifactStore,
                 force: bool = False) -> Any:
        progress.stage_started(step.node, stage)
        token = shared_key_lock.set(global_key_lock)
        try:
            result = run_stage(call_work(step, inputs), store, force)
        finally:
            shared_key_lock.reset(token)
        return _as_state(step.node, stage, result)

    return stage_step


def run_step(step: Step, inputs: dict[tuple[str, str], StageResult], store: ArtifactStore, force: bool) -> Any:
    """Run one step as its stage's task, named `<node>/<stage>` in the UI."""
    return stage_task(step.stage).with_options(task_run_name=f"{step.node}/{step.stage}")(
        step, inputs, store, force=force)
