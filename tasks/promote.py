"""Register passing candidates and move the promotion alias to the chosen one, all or nothing.

One registered model per (pipeline, target); one version per build key. The candidate whose
decision (tasks/decide.py) says it takes the alias gets `promotion.alias`. Each registered model is
promoted under its promotion lock (tasks/locks.py), in this order:

1. each passing engine not yet registered is hash-checked and run once (tasks/engine_check.py);
   one that fails is `failed` with the reason, and the alias does not move for it;
2. a version is created (or the one with the same build key reused); if another version with the
   same key appeared meanwhile, the lowest wins and the other is removed;
3. the promoted version's tags are refreshed (status, reason, metrics at promotion time);
4. the event is recorded in the version's outbox (tasks/notify.py), in one write, pending;
5. the alias moves.

A crash after 4 and before 5 leaves an event the next run abandons (the alias never reached it);
a crash after 5 leaves a pending event the next run sends. Every registry change is undone if a
later step fails, so a deploy system never sees a half-made promotion.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from tasks import engine_check, killpoints, notify, tracking
from tasks.metrics import key_metrics, stage_metrics
from tasks.outcome import CandidateOutcome, Decision
from tasks.spec import PipelineSpec, TargetSpec

REFRESHED_TAGS = ("status", "decision_reason", "promoted_at")


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
    by_target = {t.name: [o for o in outcomes if o.candidate.target == t.name and o.passed_gates] for t in spec.targets}
    names = sorted(tracking.registered_model_name(spec.name, t) for t, passing in by_target.items() if passing)
    undo = _Undo()
    decisions: list[_Decision] = []
    with contextlib.ExitStack() as held:
        for name in names:  # always in the same order: two runs never wait on each other crosswise
            held.enter_context(notify.promotion_lock(name))
        try:
            for target in spec.targets:
                passing = [o for o in by_target[target.name] if _engine_ok(spec, o)]
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


def _engine_ok(spec: PipelineSpec, outcome: CandidateOutcome) -> bool:
    """Check an engine that is about to become a new version; a bad one fails its candidate, alias unmoved."""
    name = tracking.registered_model_name(spec.name, outcome.candidate.target)
    if outcome.cache_key and tracking.find_versions(name, {"cache_key": outcome.cache_key}):
        return True  # checked when it was registered; the registry's copy is what deploys fetch
    try:
        with tempfile.TemporaryDirectory(prefix="smelter-engine-") as work_dir:
            tracking.hold_engine_files(outcome, Path(work_dir))
        if outcome.stages["build"].path.is_dir():
            engine_check.check_before_registering(spec, outcome.stages, tracking.uploaded_engine_digest(outcome.run_id))
        else:  # built on another pool's host: what is registered is its upload, checked there
            verdict = tracking.engine_check_verdict(outcome.run_id) if outcome.run_id else None
            if verdict != "passed":
                raise engine_check.EngineRejected(
                    f"built on another host, whose check before upload {'found: ' + verdict if verdict else 'did not run'}")
    except engine_check.EngineRejected as e:
        outcome.status, outcome.failed_stage = "failed", "register"
        outcome.error = f"register failed: {e}"
        outcome.decision = Decision(f"not registered: {e}")
        return False
    return True


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
    versions = {o.candidate.name: _register(name, alias, o, undo) for o in passing}
    best = next((o for o in passing if o.decision and o.decision.take_alias), None)
    previous = tracking.alias_version(name, alias)
    promoted = best is not None and previous != versions[best.candidate.name]
    if promoted:
        version = versions[best.candidate.name]
        _refresh_tags(name, version, _promotion_tags(best), undo)
        if previous and tracking.find_version(name, previous):
            _refresh_tags(name, previous, {"status": "superseded", "superseded_by": version}, undo)
        _record_event(spec, best, name, version, previous, undo)
        killpoints.reach("event.recorded")
        tracking.set_alias(name, alias, version)
        undo.add(f"restore alias {alias} of {name} to version {previous}",
                 lambda: tracking.set_alias(name, alias, previous) if previous
                 else tracking.delete_alias(name, alias))
        killpoints.reach("alias.moved")
    return [_Decision(o, name, versions[o.candidate.name], promoted and o is best) for o in passing]


def _register(name: str, alias: str, outcome: CandidateOutcome, undo: _Undo) -> str:
    """The one version for this engine's build key: an existing one, else a new one.

    Reusing keeps an unchanged nightly re-run from piling up identical versions and from
    announcing the engine already in production as a new promotion. Should another process have
    created a version for the same key meanwhile (a host outside this lock), the lowest wins.
    """
    if outcome.cache_key:
        same_engine = tracking.find_versions(name, {"cache_key": outcome.cache_key})
        if same_engine:
            return same_engine[0].version
    tags = {"candidate": outcome.candidate.name, "precision": outcome.candidate.precision,
            "target": outcome.candidate.target, "cache_key": outcome.cache_key or ""}
    tags |= _metric_tags(outcome)
    created = tracking.create_version(name, outcome.run_id, tags, description=f"engine of {outcome.candidate.name}")
    undo.add(f"delete version {created.version} of {name}", lambda: tracking.delete_version(name, created.version))
    killpoints.reach("version.created")
    if not outcome.cache_key:
        return created.version
    same_engine = tracking.find_versions(name, {"cache_key": outcome.cache_key})
    lowest = same_engine[0].version if same_engine else created.version
    if lowest != created.version:
        tracking.delete_version(name, created.version)
        undo.steps.pop()
        return lowest
    holder = tracking.alias_version(name, alias)  # never removed from under a deploy that reads the alias
    for other in same_engine[1:]:
        if other.version != holder:
            tracking.delete_version(name, other.version)
    return created.version


def _metric_tags(outcome: CandidateOutcome) -> dict[str, str]:
    return {k: f"{v:.6g}" for k, v in key_metrics(stage_metrics(outcome.stages)).items()}


def _promotion_tags(outcome: CandidateOutcome) -> dict[str, str]:
    """What a version that takes the alias says about it, now: a version getting the alias back is refreshed."""
    reason = outcome.decision.reason if outcome.decision else "promoted"
    return ({"status": "promoted", "decision_reason": reason[:tracking.MAX_TAG_CHARS],
             "promoted_at": datetime.now(UTC).isoformat(), "superseded_by": ""} | _metric_tags(outcome))


def _refresh_tags(name: str, version: str, tags: dict[str, str], undo: _Undo) -> None:
    before = tracking.get_version(name, version).tags

    def restore() -> None:
        for key in tags:
            if key in before:
                tracking.set_version_tags(name, version, {key: before[key]})
            else:
                tracking.delete_version_tag(name, version, key)

    undo.add(f"restore the tags of {name} version {version}", restore)
    tracking.set_version_tags(name, version, tags)


def _record_event(spec: PipelineSpec, outcome: CandidateOutcome, name: str, version: str, previous: str | None,
                  undo: _Undo) -> None:
    """Append the pending event to the version's outbox (one write) before the alias moves; undoable."""
    metrics = stage_metrics(outcome.stages)
    event = notify.promotion_event(spec, outcome, name, version, metrics, datetime.now(UTC).isoformat())
    before = notify.record_event(name, version, notify.new_record(spec, event, previous))
    undo.add(f"remove the event record of {name} version {version}",
             lambda: notify.restore_events(name, version, before))


def _description(spec: PipelineSpec, target: TargetSpec) -> str:
    where = f"{target.backend} on {target.arch}" if target.arch else target.backend
    return (f"Engines of pipeline '{spec.name}' ({spec.model.id or spec.model.path}) for target "
            f"'{target.name}' ({where}). Each version passed every gate; alias "
            f"'{spec.promotion.alias}' marks the one in production.")


def _model_tags(spec: PipelineSpec, target: TargetSpec) -> dict[str, str]:
    tags = {"pipeline": spec.name, "target": target.name, "backend": target.backend,
            "model": spec.model.id or spec.model.path or ""}
    return tags | ({"arch": target.arch} if target.arch else {})
