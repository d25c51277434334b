"""A Triton Inference Server model-repository entry for promoted TensorRT engines.

Layout: <repo>/<model>/config.pbtxt and <repo>/<model>/<version>/model.plan. Everything in the
config comes from what was built and measured: tensor names, types and dims from the engine
sidecar, max_batch_size from the optimization profiles, and dynamic batching's preferred sizes
from the benchmark sweep (the batch sizes that meet the latency SLO at near-best throughput).
One pipeline with several arch targets gets one entry whose plans Triton picks by compute
capability (cc_model_filenames); the first engine is also the default model.plan.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.backends.base import BackendUnavailable, get_backend
from tasks.backends.tensorrt import plan as trt_plan
from tasks.config.spec import Threshold

TRITON_TYPES = {"float32": "TYPE_FP32", "float16": "TYPE_FP16", "bfloat16": "TYPE_BF16", "int8": "TYPE_INT8",
                "int32": "TYPE_INT32", "int64": "TYPE_INT64", "bool": "TYPE_BOOL", "uint8": "TYPE_UINT8"}
PLAN = "model.plan"
NEAR_BEST_THROUGHPUT = 0.9


@dataclass(frozen=True)
class PromotedEngine:
    """One promoted engine: its build directory (model.plan + engine.json)."""

    engine_dir: Path

    @property
    def sidecar(self) -> dict[str, Any]:
        return trt_plan.read_sidecar(self.engine_dir)


def latency_slo_ms(performance_gates: dict[str, Threshold]) -> float | None:
    """The pipeline's p99 latency SLO: performance.gates.p99_ms.max, if set."""
    gate = performance_gates.get("p99_ms")
    return gate.max if gate is not None else None


def max_batch_size(profiles: list[dict[str, dict[str, list[int]]]]) -> int:
    """Every profile must serve batches 1..max_batch_size, so take the smallest batch maximum."""
    maxima = {shape["max"][0] for profile in profiles for shape in profile.values()}
    minima = {shape["min"][0] for profile in profiles for shape in profile.values()}
    if minima != {1}:
        raise ValueError(f"Triton needs every optimization profile to accept batch 1; profiles start at {sorted(minima)}")
    return min(maxima)


def preferred_batch_sizes(points: list[dict[str, Any]], slo_ms: float | None, limit: int) -> list[int]:
    """Batch sizes whose worst p99 (over the sequence lengths measured) meets the SLO and whose
    throughput is within 10% of the best such batch size: the sizes worth waiting to form."""
    worst: dict[int, dict[str, float]] = {}
    for point in points:
        batch = int(point["batch"])
        if batch > limit:
            continue
        seen = worst.setdefault(batch, {"p99_ms": 0.0, "throughput": float("inf")})
        seen["p99_ms"] = max(seen["p99_ms"], float(point["p99_ms"]))
        seen["throughput"] = min(seen["throughput"], float(point["throughput"]))
    feasible = {b: m for b, m in worst.items() if slo_ms is None or m["p99_ms"] <= slo_ms}
    if not feasible:
        return []
    best = max(m["throughput"] for m in feasible.values())
    return sorted(b for b, m in feasible.items() if m["throughput"] >= NEAR_BEST_THROUGHPUT * best)


def _tensor_block(io: dict[str, Any]) -> str:
    """Triton's dims leave out the batch axis when max_batch_size > 0."""
    dims_text = ", ".join(str(d) for d in io["shape"][1:])
    return (f"  {{\n    name: \"{io['name']}\"\n    data_type: {TRITON_TYPES[io['dtype']]}\n"
            f"    dims: [ {dims_text} ]\n  }}")


def config_pbtxt(model_name: str, sidecars: list[dict[str, Any]], benchmark_points: list[dict[str, Any]],
                 slo_ms: float | None) -> str:
    """config.pbtxt text for one engine, or for one engine per compute capability."""
    first = sidecars[0]
    for other in sidecars[1:]:
        if other["io"] != first["io"]:
            raise ValueError(f"engines for {first['target']} and {other['target']} have different inputs/outputs; "
                             f"one Triton model needs the same tensors on every arch")
    limit = min(max_batch_size(s["profiles"]) for s in sidecars)
    preferred = preferred_batch_sizes(benchmark_points, slo_ms, limit)
    inputs = [_tensor_block(t) for t in first["io"] if t["mode"] == "input"]
    outputs = [_tensor_block(t) for t in first["io"] if t["mode"] == "output"]
    lines = [f'name: "{model_name}"', 'platform: "tensorrt_plan"', f"max_batch_size: {limit}",
             "input [\n" + ",\n".join(inputs) + "\n]", "output [\n" + ",\n".join(outputs) + "\n]"]
    if preferred:
        lines.append(f"dynamic_batching {{\n  preferred_batch_size: [ {', '.join(map(str, preferred))} ]\n}}")
    else:
        lines.append("dynamic_batching { }")
    if len(sidecars) > 1:
        entries = ",\n".join(f'  {{ key: "{s["compute_capability"]}" value: "{plan_filename(s, i)}" }}'
                             for i, s in enumerate(sidecars))
        lines.append(f"cc_model_filenames [\n{entries}\n]")
    return "\n".join(lines) + "\n"


def plan_filename(sidecar: dict[str, Any], position: int) -> str:
    """The first engine is model.plan (Triton's default file); the others are named by arch."""
    return PLAN if position == 0 else f"model.{sidecar['arch']}.plan"


def write_triton_repository(repo_dir: Path, model_name: str, engines: list[PromotedEngine],
                            benchmark_points: list[dict[str, Any]], slo_ms: float | None, version: int = 1) -> Path:
    """Write <repo_dir>/<model_name>/{config.pbtxt, <version>/model.plan}; return the model directory.

    benchmark_points are the benchmark stage's "points" for the engine whose batching is configured
    (the first engine's, when there are several arches).
    """
    if not engines:
        raise ValueError("write_triton_repository needs at least one promoted engine")
    sidecars = [e.sidecar for e in engines]
    arches = [s["compute_capability"] for s in sidecars]
    if len(set(arches)) != len(arches):
        raise ValueError(f"two engines for the same compute capability: {arches}; Triton picks one plan per capability")
    model_dir = repo_dir / model_name
    version_dir = model_dir / str(version)
    version_dir.mkdir(parents=True, exist_ok=True)
    for position, (engine, sidecar) in enumerate(zip(engines, sidecars)):
        shutil.copyfile(engine.engine_dir / PLAN, version_dir / plan_filename(sidecar, position))
    (model_dir / "config.pbtxt").write_text(config_pbtxt(model_name, sidecars, benchmark_points, slo_ms))
    return model_dir


def serves(build_outputs: dict[str, Any]) -> bool:
    """Whether a build's engine is a plan Triton's TensorRT platform serves (its backend says so)."""
    try:
        return get_backend(build_outputs["backend"]).triton_plan
    except (KeyError, ValueError, BackendUnavailable):  # no backend recorded, or one not installed here
        return False


def package_promoted(pipeline: str, slo_ms: float | None, outcomes: list[Any], repo_dir: Path) -> dict[str, Path]:
    """One Triton entry per promoted candidate whose engine is a plan, keyed by its MLflow run id; `slo_ms` is the
    p99 latency its preferred batch sizes must meet (`latency_slo_ms`).

    Engines promoted in the same run for the pipeline's other arch targets (same precision) join
    the entry through cc_model_filenames, so one Triton model serves the whole fleet.
    """
    promoted = [o for o in outcomes if o.status == "promoted" and serves(o.stages["build"].outputs)]
    packages = {}
    for outcome in promoted:
        siblings = [o for o in promoted if o is not outcome and o.candidate.precision == outcome.candidate.precision]
        engines = [PromotedEngine(o.stages["build"].path) for o in [outcome, *siblings]]
        packages[outcome.run_id] = write_triton_repository(
            repo_dir / outcome.run_id, pipeline, engines, outcome.stages["benchmark"].outputs.get("points", []),
            slo_ms, version=int(outcome.model_version))
    return packages
