"""Serving packages of promoted engines, for the backends that declare one (TargetSpec.serving: TensorRT's
plans become a Triton model-repository entry).

How a package is laid out is the backend's; this module finds the promoted engines and groups them: one
package per promoted candidate, joined by the engines promoted in the same run for the pipeline's other
targets of its backend and precision (Triton picks a plan by compute capability), so one served model
covers the whole fleet.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tasks.backends.table import BACKENDS
from tasks.config.spec import Threshold


def packager(backend: str) -> Callable[..., Path] | None:
    """The function that packages `backend`'s promoted engines, or None: it packages none, or is not
    registered here."""
    info = BACKENDS.get(backend)
    if info is None or info.target.serving is None:
        return None
    module, _, function = info.target.serving.partition(":")
    return getattr(importlib.import_module(module), function)


def serves(build_outputs: dict[str, Any]) -> bool:
    """Whether a build's backend packages its promoted engines for serving (without importing it)."""
    info = BACKENDS.get(build_outputs.get("backend", ""))
    return info is not None and info.target.serving is not None


def latency_slo_ms(performance_gates: dict[str, Threshold]) -> float | None:
    """The pipeline's p99 latency SLO: performance.gates.p99_ms.max, if set."""
    gate = performance_gates.get("p99_ms")
    return gate.max if gate is not None else None


def package_promoted(pipeline: str, slo_ms: float | None, outcomes: list[Any], repo_dir: Path) -> dict[str, Path]:
    """One serving package per promoted candidate whose backend packages its engines, keyed by its MLflow run id;
    the candidate's own engine is the package's default, its benchmark points configure the batching, and
    `slo_ms` is the p99 latency its preferred batch sizes must meet (`latency_slo_ms`)."""
    promoted = [o for o in outcomes if o.status == "promoted" and serves(o.stages["build"].outputs)]
    packages = {}
    for outcome in promoted:
        backend = outcome.stages["build"].outputs["backend"]
        siblings = [o for o in promoted if o is not outcome and o.candidate.precision == outcome.candidate.precision
                    and o.stages["build"].outputs["backend"] == backend]
        packages[outcome.run_id] = packager(backend)(
            repo_dir / outcome.run_id, pipeline, [o.stages["build"].path for o in [outcome, *siblings]],
            outcome.stages["benchmark"].outputs.get("points", []), slo_ms, int(outcome.model_version))
    return packages
