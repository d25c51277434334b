"""`smelter plan`: the graph a run would execute, each stage marked cached or to-run, without running it.

A key is known only when its upstream is built (later keys hash upstream outputs), so everything
below a stage that must run is itself to-run. A target's benchmark measures all its candidates
and the champion together, so its key also depends on the registry's champion.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from tasks import accuracy, benchmark, build, export, precision, validate
from tasks.backends.base import BackendUnavailable, get_backend
from tasks.outcome import Champion
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


def pipeline_rows(spec: PipelineSpec, store: ArtifactStore,
                  champions: dict[str, Champion | None] | None = None) -> Iterator[dict[str, Any]]:
    """Every stage of one pipeline; `champions` (target -> champion) decide the benchmark keys."""
    champions = champions or {}
    builds: dict[str, dict[str, StageResult | None]] = {t.name: {} for t in spec.targets}
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
            found, key = _probe(store, spec, "accuracy", built, lambda up: accuracy.accuracy_key(up, spec))
            yield _row(label, "accuracy", found, key, blocked)
            if not blocked:
                builds[target.name][label] = built
    for target, built in builds.items():
        node = f"{spec.name}/{target}"
        if not built:
            continue
        if any(b is None for b in built.values()):
            yield _row(node, "benchmark", None, None)
            continue
        key = benchmark.benchmark_key(spec, target, built, champions.get(target))
        yield _row(node, "benchmark", store.lookup(spec.name, "benchmark", key), key)


def plan_rows(specs: PipelinesFile, store: ArtifactStore,
              champions: dict[str, dict[str, Champion | None]] | None = None) -> list[dict[str, Any]]:
    """The rows of every pipeline; `champions` maps pipeline -> target -> champion (none known: empty)."""
    champions = champions or {}
    return [row for spec in specs.pipelines.values() for row in pipeline_rows(spec, store, champions.get(spec.name))]
