"""`smelter plan`: the graph a run would execute, each stage marked cached or to-run, without running it.

A key is known only when its upstream is built (later keys hash upstream outputs), so everything
below a stage that must run is itself to-run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from tasks import accuracy, benchmark, build, export, precision, validate
from tasks.backends.base import BackendUnavailable, get_backend
from tasks.spec import PipelineSpec, PipelinesFile
from tasks.store import ArtifactStore, StageResult


def _row(node: str, stage: str, found: StageResult | None, key: str | None, note: str = "") -> dict[str, Any]:
    state = "cached" if found else ("blocked" if note else "to-run")
    return {"node": node, "stage": stage, "state": state, "key": key or "-", "note": note}


def _probe(store: ArtifactStore, spec: PipelineSpec, stage: str, upstream: StageResult | None,
           key_of: Callable[[StageResult], str]) -> tuple[StageResult | None, str | None]:
    if upstream is None:
        return None, None
    key = key_of(upstream)
    return store.lookup(spec.name, stage, key), key


def pipeline_rows(spec: PipelineSpec, store: ArtifactStore) -> Iterator[dict[str, Any]]:
    key = export.export_key(spec)
    exported = store.lookup(spec.name, "export", key)
    yield _row(spec.name, "export", exported, key)
    found, key = _probe(store, spec, "validate", exported, lambda up: validate.validate_key(up, spec))
    yield _row(spec.name, "validate", found, key)
    for p in spec.precisions:
        precise, key = _probe(store, spec, "precision", exported, lambda up: precision.precision_key(up, spec, p))
        yield _row(f"{spec.name}/{p}", "precision", precise, key)
        for target in (t for t in spec.targets if t.precision_problem(p) is None):
            label = f"{spec.name}/{p}/{target.name}"
            try:
                backend = get_backend(target.backend)
                blocked = backend.missing(target) or ""
            except BackendUnavailable as e:
                blocked = str(e)
            built, key = (None, None) if blocked else _probe(
                store, spec, "build", precise, lambda up: build.build_key(up, target, backend, list(spec.profiles)))
            yield _row(label, "build", built, key, blocked)
            for stage, key_of in (("accuracy", accuracy.accuracy_key), ("benchmark", benchmark.benchmark_key)):
                found, key = _probe(store, spec, stage, built, lambda up: key_of(up, spec))
                yield _row(label, stage, found, key, blocked)


def plan_rows(specs: PipelinesFile, store: ArtifactStore) -> list[dict[str, Any]]:
    return [row for spec in specs.pipelines.values() for row in pipeline_rows(spec, store)]
