"""Register passing candidates and move the promotion alias to the chosen one, all or nothing.

One registered model per (pipeline, target); a version per passing candidate. The candidate whose
decision (tasks/decide.py) says it takes the alias gets `promotion.alias`. Every registry change (new model or version, refreshed model description and tags,
alias, notification record) is undone if a later step fails, so a deploy system that reads
the alias never sees a promotion whose notification record was not written. The events are sent
afterwards by notify.py, once the registry is consistent.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from tasks import notify, tracking
from tasks.metrics import key_metrics, stage_metrics
from tasks.outcome import CandidateOutcome
from tasks.spec import PipelineSpec, TargetSpec


class PromotionError(RuntimeError):
    """A promotion step failed; the registry was put back as it was (the message says if not)."""


@dataclass
class _Decision:
    outcome: CandidateOutcome
    registered_model: str
    version: str
    promoted: bool


class _Undo:
    """Registry changes made so far, undone newest first if the promotion fails."""

    def __init__(self) -> None:
        self.steps: list[tuple[str, Callable[[], None]]] = []

    def add(self, what: str, action: Callable[[], None]) -> None:
        self.steps.append((what, action))

    def rollback(self) -> list[str]:
        failures = []
        for what, action in reversed(self.steps):
            try:
                action()
            except Exception as e:  # keep undoing the rest; report every step that stayed changed
                failures.append(f"{what}: {e}")
        return failures


def promote(spec: PipelineSpec, outcomes: list[CandidateOutcome]) -> list[CandidateOutcome]:
    """Register passing candidates and give the alias to the one each target's decision chose.

    Candidates must already be logged (`tracking.log_candidate` sets `run_id`): a registry version
    points at its run's `engine` artifacts. Sets status, model_name and model_version on the
    outcomes; `notify.notify_promotions` sends the recorded events afterwards. Raises
    PromotionError, leaving the registry as it was, when any registry step fails.
    """
    unlogged = [o.candidate.name for o in outcomes if o.passed_gates and not o.run_id]
    if unlogged:
        raise PromotionError(f"candidates {unlogged} passed their gates but have no MLflow run_id; "
                             "log them with tracking.log_candidate before promotion")
    undo = _Undo()
    decisions: list[_Decision] = []
    try:
        for target in spec.targets:
            passing = [o for o in outcomes if o.candidate.target == target.name and o.passed_gates]
            if passing:
                decisions += _promote_target(spec, target, passing, undo)
    except Exception as e:
        failures = undo.rollback()
        detail = f"; rollback also failed, fix by hand: {'; '.join(failures)}" if failures else "; rolled back"
        raise PromotionError(f"promotion of pipeline {spec.name} failed: {e}{detail}") from e
    for decision in decisions:
        outcome = decision.outcome
        outcome.status = "promoted" if decision.promoted else "passed"
        outcome.model_name, outcome.model_version = decision.registered_model, decision.version
    return outcomes


def _promote_target(spec: PipelineSpec, target: TargetSpec, passing: list[CandidateOutcome],
                    undo: _Undo) -> list[_Decision]:
    name = tracking.registered_model_name(spec.name, target.name)
    alias = spec.promotion.alias
    tags = _model_tags(spec, target)
    before = tracking.ensure_registered_model(name, _description(spec, target), tags)
    if before is None:
        undo.add(f"delete registered model {name}", lambda: tracking.delete_registered_model(name))
    else:
        undo.add(f"restore the description and tags of {name}",
                 lambda: tracking.restore_registered_model(before, list(tags)))
    versions = {o.candidate.name: _register(name, o, undo) for o in passing}
    best = next((o for o in passing if o.decision and o.decision.take_alias), None)
    previous = tracking.alias_version(name, alias)
    promoted = best is not None and previous != versions[best.candidate.name]
    if promoted:
        tracking.set_alias(name, alias, versions[best.candidate.name])
        undo.add(f"restore alias {alias} of {name} to version {previous}",
                 lambda: tracking.set_alias(name, alias, previous) if previous
                 else tracking.delete_alias(name, alias))
        _record_event(spec, best, name, versions[best.candidate.name], undo)
    return [_Decision(o, name, versions[o.candidate.name], promoted and o is best) for o in passing]


def _register(name: str, outcome: CandidateOutcome, undo: _Undo) -> str:
    """The version for this engine: an existing one with the same build key, else a new one.

    Reusing keeps an unchanged nightly re-run from piling up identical versions and from
    announcing the engine already in production as a new promotion.
    """
    if outcome.cache_key:
        same_engine = tracking.find_versions(name, {"cache_key": outcome.cache_key})
        if same_engine:
            return same_engine[-1].version
    metrics = stage_metrics(outcome.stages)
    tags = {"candidate": outcome.candidate.name, "precision": outcome.candidate.precision,
            "cache_key": outcome.cache_key or ""}
    tags |= {k: f"{v:.6g}" for k, v in key_metrics(metrics).items()}
    created = tracking.create_version(name, outcome.run_id, tags, description=f"engine of {outcome.candidate.name}")
    undo.add(f"delete version {created.version} of {name}", lambda: tracking.delete_version(name, created.version))
    return created.version


def _record_event(spec: PipelineSpec, outcome: CandidateOutcome, name: str, version: str, undo: _Undo) -> None:
    """Write the pending notification before anything is sent, restorable if promotion fails later."""
    metrics = stage_metrics(outcome.stages)
    event = notify.promotion_event(spec, outcome, name, version, metrics, datetime.now(UTC).isoformat())
    record = notify.pending_record(spec, event)
    if not record:
        return
    before = tracking.get_version(name, version).tags

    def restore() -> None:
        for key in record:
            if key in before:
                tracking.set_version_tags(name, version, {key: before[key]})
            else:
                tracking.delete_version_tag(name, version, key)

    undo.add(f"remove the notification record of {name} version {version}", restore)
    tracking.set_version_tags(name, version, record)


def _description(spec: PipelineSpec, target: TargetSpec) -> str:
    where = f"{target.backend} on {target.arch}" if target.arch else target.backend
    return (f"Engines of pipeline '{spec.name}' ({spec.model.id or spec.model.path}) for target "
            f"'{target.name}' ({where}). Each version passed every gate; alias "
            f"'{spec.promotion.alias}' marks the one in production.")


def _model_tags(spec: PipelineSpec, target: TargetSpec) -> dict[str, str]:
    tags = {"pipeline": spec.name, "target": target.name, "backend": target.backend,
            "model": spec.model.id or spec.model.path or ""}
    return tags | ({"arch": target.arch} if target.arch else {})
