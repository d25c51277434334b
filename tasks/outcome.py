"""What one candidate ended as: the record the gate, the tracker, promotion and the CLI share."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from tasks.spec import Candidate
from tasks.store import StageResult

Status = Literal["promoted", "passed", "rejected", "failed"]


@dataclass(frozen=True)
class GateResult:
    """One gate's verdict; `reasons` say exactly which threshold a candidate missed."""

    gate: str
    passed: bool
    reasons: tuple[str, ...] = ()


@dataclass(frozen=True)
class Decision:
    """What the decision rules concluded for one candidate: whether it takes the alias now, and why."""

    reason: str
    take_alias: bool = False


@dataclass
class CandidateOutcome:
    candidate: Candidate
    status: Status
    stages: dict[str, StageResult] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    gates: list[GateResult] = field(default_factory=list)
    error: str | None = None
    failed_stage: str | None = None
    run_id: str | None = None
    model_name: str | None = None
    model_version: str | None = None
    decision: Decision | None = None

    @property
    def gate_reasons(self) -> list[str]:
        return [f"{g.gate}: {r}" for g in self.gates for r in g.reasons]

    @property
    def passed_gates(self) -> bool:
        return self.status != "failed" and bool(self.gates) and all(g.passed for g in self.gates)

    @property
    def cache_key(self) -> str | None:
        build = self.stages.get("build")
        return build.key if build else None

    def summary(self) -> dict[str, Any]:
        """The JSON object `smelter run --json` prints for this candidate."""
        return {
            "candidate": self.candidate.name,
            "pipeline": self.candidate.pipeline,
            "precision": self.candidate.precision,
            "target": self.candidate.target,
            "status": self.status,
            "gates": [{"gate": g.gate, "passed": g.passed, "reasons": list(g.reasons)} for g in self.gates],
            "metrics": self.metrics,
            "error": self.error,
            "failed_stage": self.failed_stage,
            "stages": {name: {"key": r.key, "cached": r.cached} for name, r in self.stages.items()},
            "mlflow_run_id": self.run_id,
            "registered_model": self.model_name,
            "model_version": self.model_version,
            "decision": {"reason": self.decision.reason} if self.decision else None,
        }
