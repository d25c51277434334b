"""`smelter plan`: the graph a run would execute, each stage marked cached or to-run, without running it.

The rows are the steps of the stage graph the flow runs (tasks/graph.py), in the same order.
A key is known only when its upstream is built (later keys hash upstream outputs), so everything
below a stage that must run is itself to-run. A target's benchmark measures all its candidates
and the champion together, so its key also depends on the registry's champion. Plan verifies
what it finds as a run does, but moves nothing: a damaged output shows as to-run, with why.
The judging steps (gate, promote, package, notify) have no key: they run `always`.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

from tasks import graph
from tasks.config.spec import PipelineSpec, PipelinesFile
from tasks.outcome import Champion
from tasks.runtime.store import ArtifactStore, StageResult


def _row(step: graph.Step, state: str, key: str | None, note: str = "") -> dict[str, Any]:
    return {"node": step.node, "stage": step.stage, "state": state, "key": key or "-", "note": note}


def pipeline_rows(spec: PipelineSpec, store: ArtifactStore,
                  champions: dict[str, Champion | None] | None = None) -> Iterator[dict[str, Any]]:
    """Every step of one pipeline; `champions` (target -> champion) decide the benchmark keys.

    A target whose backend cannot run here has its build and accuracy rows `blocked` (with why)
    and no benchmark row: a run fails those candidates and measures nothing for it.
    """
    unavailable = functools.cache(lambda target: graph.unavailable(spec.target(target)))
    found: dict[graph.Ref, StageResult] = {}
    for step in graph.pipeline_steps(spec, spec.candidates(), champions):
        why = step.target and unavailable(step.target)
        if why:
            if step.stage != "benchmark":
                yield _row(step, "blocked", None, why)
            continue
        if step.judges:
            yield _row(step, "always", None, f"reads {step.reads}")
            continue
        if any(ref not in found for ref in step.needs):
            yield _row(step, "to-run", None)
            continue
        work = graph.call_work(step, found)
        result, problem = store.check(spec.name, step.stage, work.key, repair=False)
        if result is not None:
            found[step.ref] = result
        if result is not None and not work.reusable(result):
            yield _row(step, "to-run", work.key, "published while the machine was busy: measured again")
            continue
        yield _row(step, "cached" if result else "to-run", work.key, f"damaged: {problem}" if problem else "")


def plan_rows(specs: PipelinesFile, store: ArtifactStore,
              champions: dict[str, dict[str, Champion | None]] | None = None) -> list[dict[str, Any]]:
    """The rows of every pipeline; `champions` maps pipeline -> target -> champion (none known: empty)."""
    champions = champions or {}
    return [row for spec in specs.pipelines.values() for row in pipeline_rows(spec, store, champions.get(spec.name))]
