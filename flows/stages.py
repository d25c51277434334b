"""Prefect tasks over the stage runner; the only place stages meet Prefect.

Stages cache in the artifact store (content-addressed and hash-verified, so a hit whose directory
is gone or damaged simply rebuilds). A hit returns Prefect's `Cached` state so the UI shows it as
such; Prefect's own result cache stays off because it cannot know the artifact directory is still
intact. Producing one key is guarded by a Prefect global concurrency slot named from the key (so two
runs, also on two hosts, build it once), inside which the store's file lock guards this host.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.states import Completed

from flows import progress
from tasks.graph import Step, call_work
from tasks.runtime import locks
from tasks.runtime.stage_runner import run_stage, shared_key_lock
from tasks.runtime.store import ArtifactStore, StageResult

locks.report_waits_to(progress.message)  # a waiter's notices reach the terminal and the run log


def limit_name(key_name: str) -> str:
    return f"smelter-build-{key_name}"


def global_key_lock(key_name: str) -> contextlib.AbstractContextManager[None]:
    """One holder at a time for this key across every run talking to this Prefect API (tasks/runtime/locks.py
    says how a dead holder's slot is taken over)."""
    return locks.held_slot(limit_name(key_name), key_name)


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
