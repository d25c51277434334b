"""One set of metric names for gates, MLflow, the registry, the webhook and `smelter run --json`.

The same names every run is what makes the MLflow compare view line up across nights.
"""

from __future__ import annotations

from typing import Any

from tasks.store import StageResult

GATE_POINT_METRICS = ("p50_ms", "p90_ms", "p99_ms", "throughput", "speedup_vs_reference")
POINT_METRICS = ("p50_ms", "p90_ms", "p99_ms", "mean_ms", "throughput", "tokens_per_s",
                 "reference_p50_ms", "reference_p99_ms", "reference_throughput", "speedup_vs_reference")
DECODE_METRICS = ("p50_ms", "p99_ms", "reference_p50_ms", "speedup_vs_reference")
BUILD_METRICS = ("build_seconds", "engine_bytes")


def stage_metrics(stages: dict[str, StageResult]) -> dict[str, float]:
    """Every metric a candidate's stages measured: accuracy.*, the gate point, each (batch, seq), decode, build."""
    metrics: dict[str, Any] = {}
    if accuracy := stages.get("accuracy"):
        metrics |= {f"accuracy.{k}": v for k, v in accuracy.outputs.get("metrics", {}).items()}
    if benchmark := stages.get("benchmark"):
        outputs = benchmark.outputs
        gate_point = outputs.get("gate_point") or {}
        metrics |= {k: gate_point[k] for k in GATE_POINT_METRICS if k in gate_point}
        for point in outputs.get("points", []):
            prefix = f"b{point['batch']}_s{point['seq']}"
            metrics |= {f"{prefix}.{k}": point[k] for k in POINT_METRICS if k in point}
        for step in outputs.get("decode", []):
            prefix = f"decode_b{step['batch']}_p{step['past']}"
            metrics |= {f"{prefix}.{k}": step[k] for k in DECODE_METRICS if k in step}
    if build := stages.get("build"):
        metrics |= {k: build.outputs[k] for k in BUILD_METRICS if k in build.outputs}
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}


def key_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """The few numbers a deploy decision reads: accuracy, gate-point speed, engine size and build time."""
    keep = set(GATE_POINT_METRICS) | set(BUILD_METRICS)
    return {k: v for k, v in metrics.items() if k in keep or k.startswith("accuracy.")}
