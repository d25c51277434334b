"""Thin Prefect tasks over the plain stage functions; the only place stages meet Prefect.

Stages cache in the artifact store (content-addressed, so a cache hit whose directory is gone
simply rebuilds). A hit returns Prefect's `Cached` state so the UI shows it as such; Prefect's
own result cache stays off because it cannot know the artifact directory still exists.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.states import Completed

from flows import progress
from tasks import accuracy, benchmark, build, export, precision, validate
from tasks.store import StageResult


def _as_state(label: str, stage: str, result: StageResult) -> Any:
    progress.stage_done(label, stage, cached=result.cached)
    if result.cached:
        return Completed(data=result, name="Cached", message=f"artifact {result.key} already built")
    return result


def _stage_task(stage: str, run: Callable[..., StageResult]) -> Any:
    @task(name=stage, cache_policy=NO_CACHE, persist_result=False)
    def stage_task(label: str, *args: Any, **kwargs: Any) -> Any:
        progress.stage_started(label, stage)
        return _as_state(label, stage, run(*args, **kwargs))

    return stage_task


export_task = _stage_task("export", export.run_export)
validate_task = _stage_task("validate", validate.run_validate)
precision_task = _stage_task("precision", precision.run_precision)
build_task = _stage_task("build", build.run_build)
accuracy_task = _stage_task("accuracy", accuracy.run_accuracy)
benchmark_task = _stage_task("benchmark", benchmark.run_benchmark)
