"""Every gate a candidate must pass before it may be promoted, each with the reasons it failed.

Comparisons against the champion use the speedup over the PyTorch reference, which each run
measures side by side with its engine; absolute milliseconds from two different nights differ
by machine noise more than by engine quality.
"""

from __future__ import annotations

from typing import Any

from tasks.outcome import GateResult
from tasks.spec import PipelineSpec, Threshold

HIGHER_IS_BETTER = ("cosine_mean", "cosine_min", "label_agreement", "top1_agreement", "throughput",
                    "speedup_vs_reference")


def _check(name: str, thresholds: dict[str, Threshold], values: dict[str, float]) -> GateResult:
    reasons = []
    for metric, threshold in thresholds.items():
        value = values.get(metric)
        if value is None:
            reasons.append(f"{metric} was not measured")
        elif why := threshold.violation(value):
            reasons.append(f"{metric} {why}")
    return GateResult(name, not reasons, tuple(reasons))


def validity_gate(validity: dict[str, Any] | None) -> GateResult:
    if not validity:
        return GateResult("validity", False, ("validity was not checked",))
    reasons = list(validity.get("problems", []))
    if not validity.get("finite", False) and not reasons:
        reasons.append("outputs contain NaN or Inf")
    for point, ok in validity.get("points", {}).items():
        if not ok and not any(point in r for r in reasons):
            reasons.append(f"outputs at the {point} shape do not match")
    return GateResult("validity", not reasons, tuple(reasons))


def champion_gate(spec: PipelineSpec, metrics: dict[str, float], champion: dict[str, Any] | None) -> GateResult:
    """No regression vs the current champion beyond the configured tolerances."""
    if not champion:
        return GateResult("champion", True, ())
    theirs = champion.get("metrics", {})
    reasons = []
    for metric in spec.accuracy.gates:
        mine, best = metrics.get(f"accuracy.{metric}"), theirs.get(f"accuracy.{metric}")
        if mine is None or best is None:
            continue
        tolerance = spec.accuracy.champion_tolerance
        worse = mine < best - tolerance if metric in HIGHER_IS_BETTER else mine > best + tolerance * max(abs(best), 1)
        if worse:
            reasons.append(f"accuracy.{metric} {mine:.6g} regresses vs champion v{champion['version']} "
                           f"({best:.6g}, tolerance {tolerance})")
    mine, best = metrics.get("speedup_vs_reference"), theirs.get("speedup_vs_reference")
    tolerance = spec.performance.regression_tolerance
    if mine is not None and best is not None and mine < best * (1 - tolerance):
        reasons.append(f"speedup_vs_reference {mine:.3f} regresses vs champion v{champion['version']} "
                       f"({best:.3f}, tolerance {tolerance:.0%})")
    return GateResult("champion", not reasons, tuple(reasons))


def evaluate(spec: PipelineSpec, metrics: dict[str, float], validity: dict[str, Any] | None,
             champion: dict[str, Any] | None) -> list[GateResult]:
    """All gates for one candidate (metrics named as in tasks.metrics), in the order a user reads them."""
    accuracy_values = {k.removeprefix("accuracy."): v for k, v in metrics.items() if k.startswith("accuracy.")}
    return [
        validity_gate(validity),
        _check("accuracy", spec.accuracy.gates, accuracy_values),
        _check("performance", spec.performance.gates, metrics),
        champion_gate(spec, metrics, champion),
    ]
