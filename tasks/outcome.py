"""What one candidate ended as: the record the gate, the tracker, promotion and the CLI share."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from tasks.config.spec import Candidate
from tasks.metrics import RATIOS
from tasks.runtime.store import StageResult

# pending: judged on numbers taken on a busy machine; neither rejected nor registered, the next quiet run decides
Status = Literal["promoted", "passed", "pending", "rejected", "failed"]


@dataclass(frozen=True)
class GateResult:
    """One gate's verdict; `reasons` say exactly which threshold a candidate missed."""

    gate: str
    passed: bool
    reasons: tuple[str, ...] = ()
    inconclusive: bool = False  # not passed, because it could not be judged (timing on a busy machine)
    missed: tuple[str, ...] = ()  # the figures whose bound it missed, a word each (tasks.metrics short_name)


@dataclass(frozen=True)
class Champion:
    """The registry version holding the promotion alias of one (pipeline, target) when the run starts."""

    registered_model: str
    version: str
    run_id: str
    build_key: str | None
    precision: str | None
    engine_identity: str | None = None  # its engine files' sha256 (tasks/stages/champion.py `same_engine`); None: older ones
    model_source: str | None = None  # the model files its engine was built from (tasks/stages/champion.py `built_from`)

    @property
    def label(self) -> str:
        return f"champion v{self.version}"


@dataclass(frozen=True)
class Decision:
    """What the decision rules concluded for one candidate: whether it takes the alias now, and why."""

    reason: str
    take_alias: bool = False
    vs_champion: dict[str, Any] | None = None  # {"version", "ratio", "ci", "conclusive"}
    holds_alias: bool = False  # after this run: it took the alias, or kept it
    champion: str | None = None  # the version holding the alias when this was decided: the alias moves only from it

    def as_dict(self) -> dict[str, Any]:
        return {"reason": self.reason, "take_alias": self.take_alias, "holds_alias": self.holds_alias,
                "vs_champion": self.vs_champion, "champion": self.champion}


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
    def missed_gates(self) -> list[str]:
        """Why it was rejected, a word per gate, as the summary figure and the runs table say it: each figure
        whose bound it missed (`speedup`, `p99_ms`, `cosine_min`), else the failed gate's name (validity,
        regression, accuracy for a NaN sample)."""
        words = [word for g in self.gates if not g.passed and not g.inconclusive for word in (g.missed or (g.gate,))]
        return list(dict.fromkeys(words))

    @property
    def gate_reasons(self) -> list[str]:
        return [f"{g.gate}: {r}" for g in self.gates for r in g.reasons]

    @property
    def reason(self) -> str:
        """The one line a user reads next to the status: a failed candidate's error (not a decision made before
        it failed), else the decision's reason, else what failed."""
        if self.status == "failed" and self.error:
            return self.error
        if self.decision is not None:
            return self.decision.reason
        return self.error or "; ".join(self.gate_reasons)

    @property
    def passed_gates(self) -> bool:
        return self.status not in ("failed", "pending") and bool(self.gates) and all(g.passed for g in self.gates)

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
            "metrics": self.metrics | {f"{r}_ci": [self.metrics[f"{r}_ci_low"], self.metrics[f"{r}_ci_high"]]
                                       for r in RATIOS if f"{r}_ci_low" in self.metrics},
            "error": self.error,
            "failed_stage": self.failed_stage,
            "stages": {name: {"key": r.key, "cached": r.cached} | _contended(r) | _repaired(r) | _kept(r)
                       for name, r in self.stages.items()},
            "mlflow_run_id": self.run_id,
            "registered_model": self.model_name,
            "model_version": self.model_version,
            "decision": self.decision.as_dict() if self.decision else None,
        }


STATUSES = ("promoted", "passed", "rejected", "pending", "failed")  # the order an outcome's counts are said in


def counted(statuses: Iterable[str]) -> str:
    """`1 promoted, 2 rejected`: the outcomes a run had, none that it had not (a flow run's name in Prefect, a
    pipeline run's status in MLflow)."""
    counts = Counter(statuses)
    return ", ".join(f"{counts[s]} {s}" for s in STATUSES if counts[s]) or "no candidates"


def tally(statuses: Iterable[str]) -> str:
    """How a run ended, e.g. "1 promoted, 2 rejected, 0 pending, 0 failed" (and how many passed without
    being promoted, when any did): the flow run's final message."""
    counts = Counter(statuses)
    text = ", ".join(f"{counts[s]} {s}" for s in STATUSES if s != "passed")
    return text + (f"; {counts['passed']} passed, not promoted" if counts["passed"] else "")


def pending_events(summaries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """This run's webhook deliveries that did not get through yet (one per event and webhook)."""
    seen: dict[str, dict[str, Any]] = {}
    for summary in summaries:
        for delivery in summary.get("events") or []:
            seen[delivery["delivery_id"]] = delivery
    return [d for d in seen.values() if d["status"] == "pending"]


def _repaired(stage: StageResult) -> dict[str, str]:
    """A damaged earlier output of this stage was moved aside and rebuilt: where it went and why."""
    return {"repaired": stage.repaired} if stage.repaired else {}


def _kept(stage: StageResult) -> dict[str, str]:
    """The stage ran again and kept its published output: why."""
    return {"kept": stage.kept} if stage.kept else {}


def _contended(stage: StageResult) -> dict[str, bool]:
    """A measurement says whether other processes competed for the CPU while it ran."""
    host = stage.outputs.get("host")
    return {"contended": bool(host.get("contended"))} if isinstance(host, dict) else {}
