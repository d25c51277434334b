"""Which gates decide a pipeline's candidates, and a word for each one a candidate missed: what the summary
figure labels a rejected bar with and what the parent run's table says, so both name the same gate."""

from __future__ import annotations

from tasks.config.settings import GateSettings
from tasks.config.spec import Threshold
from tasks.outcome import CandidateOutcome

RATIO = "speedup_vs_reference"


def gated_figures(gates: GateSettings) -> dict[str, Threshold | None]:
    """Every figure a bound of the file decides on, named as in the candidate's metrics, speed first (shown
    even without a bound: it is what the run measured against PyTorch)."""
    figures: dict[str, Threshold | None] = {RATIO: gates.performance.get(RATIO)}
    figures |= {metric: bound for metric, bound in gates.performance.items() if metric != RATIO}
    figures |= {f"accuracy.{metric}": bound for metric, bound in gates.accuracy.items()}
    return figures


def short_name(metric: str) -> str:
    """The word a bar is labelled with: `p99_ms`, `cosine_min`, `speedup`."""
    return "speedup" if metric == RATIO else metric.removeprefix("accuracy.")


def missed_gates(gates: GateSettings, outcome: CandidateOutcome) -> list[str]:
    """Why a rejected candidate was rejected, a word per gate: each bound its figure misses (or a figure not
    measured), then any other failed gate by its name (validity, regression)."""
    words = [short_name(metric) for metric, bound in gated_figures(gates).items()
             if bound is not None and misses(bound, outcome.metrics.get(metric))]
    named = {"accuracy", "performance"} if words else set()
    words += [g.gate for g in outcome.gates if not g.passed and not g.inconclusive and g.gate not in named]
    return list(dict.fromkeys(words))


def misses(bound: Threshold, value: float | None) -> bool:
    """Not measured, NaN, or on the wrong side: what the gate fails (tasks/judge/gates.py)."""
    return value is None or bound.violation(value) is not None
