"""Every gate a candidate must pass on its own before it may be registered, each with its reasons.

Threshold gates judge the candidate against the file's limits (accuracy vs the PyTorch reference,
validity, performance); the regression gate compares its accuracy with the previous registered
version of the same (pipeline, precision, target) measured on the same eval text — never with another
precision's numbers, nor with figures from another text. Speed
against the champion is not a gate: it decides who holds the alias (tasks/judge/decide.py).

Timing measured while other processes used the CPU (tasks/measure/hostload.py) judges nothing: the
performance gate is then inconclusive (the candidate ends `pending`), whatever the numbers say;
accuracy and validity gates still apply.
"""

from __future__ import annotations

import math
from typing import Any

from tasks.config.settings import GateSettings
from tasks.config.spec import Threshold
from tasks.metrics import HIGHER_IS_BETTER, short_name
from tasks.outcome import GateResult


def _check(name: str, thresholds: dict[str, Threshold], values: dict[str, float]) -> GateResult:
    reasons, missed = [], []
    for metric, threshold in thresholds.items():
        value = values.get(metric)
        if value is None:
            reasons.append(f"{metric} was not measured")
        elif why := threshold.violation(value):
            interval = values.get(f"{metric}_ci_low"), values.get(f"{metric}_ci_high")
            shown = f" (95% interval [{interval[0]:.3g}, {interval[1]:.3g}])" if None not in interval else ""
            reasons.append(f"{metric} {why}{shown}")
        else:
            continue
        missed.append(short_name(metric))
    return GateResult(name, not reasons, tuple(reasons), missed=tuple(missed))


def performance_gate(thresholds: dict[str, Threshold], metrics: dict[str, float]) -> GateResult:
    """The `performance.gates` thresholds, or inconclusive when the measurement was contended: a busy
    machine neither fails nor passes a candidate on speed (nor crowns one: tasks/judge/decide.py)."""
    if metrics.get("host.contended"):
        share = metrics.get("host.foreign_cpu_share", float("nan"))
        return GateResult("performance", False, (f"inconclusive: machine busy (other processes used {share:.0%} of "
                                                 "the CPU while it was timed); speed not judged",), inconclusive=True)
    return _check("performance", thresholds, metrics)


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


def regression_gate(settings: GateSettings, metrics: dict[str, float], previous: dict[str, Any] | None) -> GateResult:
    """No gated accuracy metric worse than the previous version of the same precision beyond the tolerance.

    The tolerance is relative to the previous value; for errors (lower is better) below 1 it is
    relative to 1, so float noise of 1e-6 against 2e-6 is no regression. A metric the previous
    version lacks is not compared; one this candidate lacks fails (the accuracy gate says so too).
    Figures measured on other eval data (`other_data`, tasks/registry/versions.py) are not compared: the
    gate passes and says why.
    """
    if not previous:
        return GateResult("regression", True, ())
    if previous.get("other_data"):
        return GateResult("regression", True, (
            f"not compared: v{previous['version']} of the same precision, and every earlier one, was measured on "
            f"other eval data ({settings.eval_data} or accuracy.samples changed since)",))
    theirs, tolerance, reasons = previous.get("metrics", {}), settings.regression_tolerance, []
    for metric in settings.accuracy:
        best = theirs.get(f"accuracy.{metric}")
        if best is None or not math.isfinite(best):
            continue
        mine = metrics.get(f"accuracy.{metric}")
        if mine is None or not math.isfinite(mine):
            reasons.append(f"accuracy.{metric} was not measured (v{previous['version']} had {best:.6g})")
            continue
        if metric in HIGHER_IS_BETTER:
            worse, limit = mine < best * (1 - tolerance), best * (1 - tolerance)
        else:
            worse, limit = mine > best + tolerance * max(abs(best), 1.0), best + tolerance * max(abs(best), 1.0)
        if worse:
            reasons.append(f"accuracy.{metric} {mine:.6g} regresses vs v{previous['version']} of the same precision "
                           f"({best:.6g}; limit {limit:.6g} at tolerance {tolerance:.0%})")
    return GateResult("regression", not reasons, tuple(reasons))


def accuracy_gate(thresholds: dict[str, Threshold], values: dict[str, float],
                  validity: dict[str, Any] | None) -> GateResult:
    """The `accuracy.gates` thresholds, and no sample with a NaN or Inf figure: a mean over samples may hide one,
    so each is named (the accuracy stage records them with its validity checks)."""
    checked = _check("accuracy", thresholds, values)
    bad = (validity or {}).get("nonfinite_samples") or {}
    named = tuple(f"{column} is NaN or Inf in sample{'s' if len(samples) > 1 else ''} "
                  f"{', '.join(map(str, samples[:5]))}{f' and {len(samples) - 5} more' if len(samples) > 5 else ''}"
                  for column, samples in sorted(bad.items()))
    return GateResult("accuracy", checked.passed and not named, checked.reasons + named, missed=checked.missed)


def evaluate(settings: GateSettings, metrics: dict[str, float], validity: dict[str, Any] | None,
             previous: dict[str, Any] | None) -> list[GateResult]:
    """All gates for one candidate (metrics named as in tasks.metrics), in the order a user reads them."""
    accuracy_values = {k.removeprefix("accuracy."): v for k, v in metrics.items() if k.startswith("accuracy.")}
    return [
        validity_gate(validity),
        accuracy_gate(settings.accuracy, accuracy_values, validity),
        performance_gate(settings.performance, metrics),
        regression_gate(settings, metrics, previous),
    ]
