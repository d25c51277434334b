"""Which figures the gates of a pipeline decide on, each with its bound: the summary figure's panels. The word
for each one a candidate missed is the gate's own (CandidateOutcome.missed_gates), so the figure and the runs
table name the same gate."""

from __future__ import annotations

from tasks.config.settings import GateSettings
from tasks.config.spec import Threshold

RATIO = "speedup_vs_reference"


def gated_figures(gates: GateSettings) -> dict[str, Threshold | None]:
    """Every figure a bound of the file decides on, named as in the candidate's metrics, speed first (shown
    even without a bound: it is what the run measured against PyTorch)."""
    figures: dict[str, Threshold | None] = {RATIO: gates.performance.get(RATIO)}
    figures |= {metric: bound for metric, bound in gates.performance.items() if metric != RATIO}
    figures |= {f"accuracy.{metric}": bound for metric, bound in gates.accuracy.items()}
    return figures


def misses(bound: Threshold, value: float | None) -> bool:
    """Not measured, NaN, or on the wrong side: what the gate fails (tasks/judge/gates.py)."""
    return value is None or bound.violation(value) is not None
