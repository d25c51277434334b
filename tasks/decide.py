"""Which passing candidate of each target takes the promotion alias, and why each one does or does not.

Kept apart from promote.py: this module only decides (it reads measurements and the champion);
promote.py only applies a decision to the registry.
"""

from __future__ import annotations

from typing import Any

from tasks.metrics import stage_metrics
from tasks.outcome import CandidateOutcome, Decision
from tasks.spec import PipelineSpec


def best_candidate(spec: PipelineSpec, passing: list[CandidateOutcome]) -> CandidateOutcome:
    """Highest gate-point throughput, or lowest p99 latency, per `performance.objective`."""
    def score(outcome: CandidateOutcome) -> float:
        metrics = stage_metrics(outcome.stages)
        if spec.performance.objective == "throughput":
            return -metrics.get("throughput", float("-inf"))
        return metrics.get("p99_ms", float("inf"))
    return min(sorted(passing, key=lambda o: o.candidate.name), key=score)


def decide(spec: PipelineSpec, outcomes: list[CandidateOutcome],
           champions: dict[str, dict[str, Any] | None]) -> list[CandidateOutcome]:
    """Set `decision` on every candidate that passed its gates; the others keep None."""
    for target in spec.targets:
        passing = [o for o in outcomes if o.candidate.target == target.name and o.passed_gates]
        if not passing:
            continue
        best = best_candidate(spec, passing)
        for outcome in passing:
            if outcome is best:
                outcome.decision = Decision("best passing candidate", take_alias=True)
            else:
                outcome.decision = Decision(f"{best.candidate.name} is faster")
    return outcomes
