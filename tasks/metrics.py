"""One set of metric names for gates, MLflow, the registry, the webhook and `smelter run --json`.

The same names every run is what makes the MLflow compare view line up across nights.
"""

from __future__ import annotations

from typing import Any

from tasks.runtime.store import StageResult

RATIOS = ("speedup_vs_reference", "vs_champion")
GATE_POINT_METRICS = ("p50_ms", "p90_ms", "p99_ms", "throughput", *RATIOS)
POINT_METRICS = ("p50_ms", "p90_ms", "p99_ms", "mean_ms", "throughput", "tokens_per_s",
                 "reference_p50_ms", "reference_p99_ms", "reference_throughput", *RATIOS)
DECODE_METRICS = ("p50_ms", "p99_ms", "tokens_per_s", "reference_p50_ms", *RATIOS)
BUILD_METRICS = ("build_seconds", "engine_bytes")
KEY_METRICS = (*GATE_POINT_METRICS, *(f"{r}_ci_{end}" for r in RATIOS for end in ("low", "high")), *BUILD_METRICS)
# Gated metrics where a larger value is a better engine; every other gated metric (errors, latencies, perplexity
# delta) is better lower. The regression gate compares in this direction, and a gate bound on the other side is refused.
HIGHER_IS_BETTER = ("cosine_mean", "cosine_min", "label_agreement", "top1_agreement", "throughput",
                    "speedup_vs_reference")


def short_name(metric: str) -> str:
    """The word a gated figure goes by where a line is short (the summary figure's bars, the runs table's
    reason cell): `speedup`, `p99_ms`, `cosine_min`."""
    return "speedup" if metric == "speedup_vs_reference" else metric.removeprefix("accuracy.")


def _point(row: dict[str, Any], names: tuple[str, ...], prefix: str = "") -> dict[str, Any]:
    """The named figures of one measured point; a ratio also gives its interval as `<name>_ci_low/high`."""
    found = {f"{prefix}{k}": row[k] for k in names if k in row}
    for ratio in RATIOS:
        if ratio in names and isinstance(row.get(f"{ratio}_ci"), list):
            low, high = row[f"{ratio}_ci"]
            found |= {f"{prefix}{ratio}_ci_low": low, f"{prefix}{ratio}_ci_high": high}
    return found


def stage_metrics(stages: dict[str, StageResult]) -> dict[str, float]:
    """Every metric a candidate's stages measured: accuracy.*, the gate point, each (batch, seq), decode, build."""
    metrics: dict[str, Any] = {}
    if accuracy := stages.get("accuracy"):
        metrics |= {f"accuracy.{k}": v for k, v in accuracy.outputs.get("metrics", {}).items()}
    if benchmark := stages.get("benchmark"):
        outputs = benchmark.outputs
        host = outputs.get("host") or {}
        if host.get("foreign_cpu_share") is not None:  # how busy the machine was: timing gates read it
            metrics |= {"host.foreign_cpu_share": host["foreign_cpu_share"],
                        "host.contended": float(bool(host.get("contended")))}
        metrics |= _point(outputs.get("gate_point") or {}, GATE_POINT_METRICS)
        for point in outputs.get("points", []):
            metrics |= _point(point, POINT_METRICS, f"b{point['batch']}_s{point['seq']}.")
        for step in outputs.get("decode", []):
            metrics |= _point(step, DECODE_METRICS, f"decode_b{step['batch']}_p{step['past']}.")
    if build := stages.get("build"):
        metrics |= {k: build.outputs[k] for k in BUILD_METRICS if k in build.outputs}
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def key_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """The few numbers a deploy decision reads: accuracy, gate-point speed and its interval, engine size and build time."""
    return {k: v for k, v in metrics.items() if k in KEY_METRICS or k.startswith("accuracy.")}
