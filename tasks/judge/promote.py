"""Register passing candidates and move the promotion alias to the chosen one, all or nothing.

One registered model per (pipeline, target); one version per engine, known by its files' digest
(tag `engine_identity`): the same bytes never make two versions, and a rebuild from the same inputs
with other bytes (TensorRT is not bit-reproducible; `--force`, a repair) is a new version. The
candidate whose decision (tasks/judge/decide.py) says it takes the alias gets `promotion.alias`. Each
registered model is promoted under its promotion lock (tasks/runtime/locks.py, which other hosts honour
through Prefect), in this order:

1. each passing engine not yet registered is hash-checked and run once (tasks/stages/engine_check.py);
   one that fails is `failed` with the reason, and the alias does not move for it;
2. a version is created (or the one with the same bytes reused, its metric tags, description and
   engine card brought to today's measurement when that one is newer); if another version with
   the same bytes appeared meanwhile, the lowest wins, the other is removed, and the run whose version
   went says which one was kept;
3. compare-and-set: the alias is read again; if it no longer points where it pointed when the
   decision was taken (another run or a person moved it), nothing moves and the candidate says why;
4. the promoted version's tags are refreshed (status, reason, metrics at promotion time);
5. the event is recorded in the version's outbox (tasks/judge/notify.py), in one write, pending;
6. the alias moves.

A crash after 5 and before 6 leaves an event the next run abandons (the alias never reached it);
a crash after 6 leaves a pending event the next run sends. Every registry change is undone if a
later step fails, so a deploy system never sees a half-made promotion.
"""

from __future__ import annotations

import contextlib
import dataclasses
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from tasks.config.settings import RegistrySettings, RunSettings
from tasks.config.spec import TargetSpec
from tasks.judge import notify
from tasks.metrics import key_metrics, stage_metrics
from tasks.outcome import CandidateOutcome, Decision
from tasks.registry import tracking
from tasks.runtime import killpoints
from tasks.stages import engine_check
from tasks.stages.champion import built_from

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


def promote(registry: RegistrySettings, record: RunSettings,
            outcomes: list[CandidateOutcome]) -> list[CandidateOutcome]:
    """Register passing candidates and give the alias to the one each target's decision chose; `record` is what
    a registered model's description and tags name, the engine check and the engine card read of the pipeline.

    Candidates must already be logged (`tracking.log_candidate` sets `run_id`): a registry version
    points at its run's `engine` artifacts. The alias moves only from the version the decision saw
    (`Decision.champion`). Sets status, model_name and model_version on the outcomes;
    `notify.notify_promotions` sends the recorded events afterwards. Raises PromotionError, leaving
    the registry as it was, when any registry step fails.
    """
    unlogged = [o.candidate.name for o in outcomes if o.passed_gates and not o.run_id]
    if unlogged:
        raise PromotionError(f"candidates {unlogged} passed their gates but have no MLflow run_id; "
                             "log them with tracking.log_candidate before promotion")
    by_target = {t.name: [o for o in outcomes if o.candidate.target == t.name and o.passed_gates]
                 for t in record.targets}
    names = sorted(registry.model_name(t) for t, passing in by_target.items() if passing)
    undo = _Undo()
    decisions: list[_Decision] = []
    with contextlib.ExitStack() as held:
        for name in names:  # always in the same order: two runs never wait on each other crosswise
            held.enter_context(notify.promotion_lock(name))
        try:
            for target in record.targets:
                passing = [o for o in by_target[target.name] if _engine_ok(registry, record, o)]
                if passing:
                    decisions += _promote_target(registry, record, target, passing, undo)
        except Exception as e:
            failures = undo.rollback()
            detail = f"; rollback also failed, fix by hand: {'; '.join(failures)}" if failures else "; rolled back"
            raise PromotionError(f"promotion of pipeline {registry.pipeline} failed: {e}{detail}") from e
    for decision in decisions:
        outcome = decision.outcome
        outcome.status = "promoted" if decision.promoted else "passed"
        outcome.model_name, outcome.model_version = decision.registered_model, decision.version
    return outcomes


def _engine_ok(registry: RegistrySettings, record: RunSettings, outcome: CandidateOutcome) -> bool:
    """Check an engine that is about to become a new version; a bad one fails its candidate, alias unmoved."""
    name = registry.model_name(outcome.candidate.target)
    if _same_engine(name, outcome):
        return True  # checked when it was registered; the registry's copy is what deploys fetch
    try:
        with tempfile.TemporaryDirectory(prefix="smelter-engine-") as work_dir:
            tracking.hold_engine_files(outcome, Path(work_dir))
        if outcome.stages["build"].path.is_dir():
            engine_check.check_before_registering(record.targets, record.profiles, outcome.stages,
                                                  tracking.uploaded_engine_digest(outcome.run_id))
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


def _promote_target(registry: RegistrySettings, record: RunSettings, target: TargetSpec,
                    passing: list[CandidateOutcome], undo: _Undo) -> list[_Decision]:
    name = registry.model_name(target.name)
    alias = registry.alias
    tags = _model_tags(record, target)
    before = tracking.ensure_registered_model(name, _description(record, target, alias), tags)
    if before is None:
        undo.add(f"delete registered model {name}", lambda: tracking.delete_registered_model(name))
    else:
        undo.add(f"restore the description and tags of {name}",
                 lambda: tracking.restore_registered_model(before, list(tags)))
    versions = {o.candidate.name: _register(registry, record, name, o, undo) for o in passing}
    best = next((o for o in passing if o.decision and o.decision.take_alias), None)
    previous = tracking.alias_version(name, alias)  # read again under the lock: compare, then set
    if best is not None and previous not in (best.decision.champion, versions[best.candidate.name]):
        _alias_moved_meanwhile(passing, alias, best.decision.champion, previous)
        best = None
    promoted = best is not None and previous != versions[best.candidate.name]
    if promoted:
        version = versions[best.candidate.name]
        _refresh_tags(name, version, _promotion_tags(best), undo)
        _redescribe(name, version, f"promoted: holds @{alias}", _metric_tags(best), best.decision.reason, undo)
        if previous and tracking.find_version(name, previous):
            _refresh_tags(name, previous, {"status": "superseded", "superseded_by": version}, undo)
            _redescribe(name, previous, f"superseded by v{version}", tracking.get_version(name, previous).tags,
                        f"v{version} took @{alias}: {best.decision.reason}", undo)
        _record_event(registry, best, name, version, previous, undo)
        killpoints.reach("event.recorded")
        tracking.set_alias(name, alias, version)
        undo.add(f"restore alias {alias} of {name} to version {previous}",
                 lambda: tracking.set_alias(name, alias, previous) if previous
                 else tracking.delete_alias(name, alias))
        killpoints.reach("alias.moved")
    return [_Decision(o, name, versions[o.candidate.name], promoted and o is best) for o in passing]


def _alias_moved_meanwhile(passing: list[CandidateOutcome], alias: str, seen: str | None, now: str | None) -> None:
    """The alias left the version the decision compared against: a newer champion is never overwritten, nor
    judged on a comparison with another engine. Nothing moves; the next run measures against the new one."""
    was, found = f"v{seen}" if seen else "no version", f"v{now}" if now else "no version"
    why = (f"alias {alias} moved from {was} to {found} after this run decided (another run, or by hand); "
           f"nothing moves: the next run compares with {found}")
    for outcome in passing:
        if outcome.decision and (outcome.decision.take_alias or outcome.decision.holds_alias):
            outcome.decision = Decision(f"{outcome.decision.reason}; not applied: {why}",
                                        vs_champion=outcome.decision.vs_champion, champion=seen)


def _same_engine(name: str, outcome: CandidateOutcome) -> list[tracking.RegisteredVersion]:
    """The versions already holding this candidate's engine bytes, oldest first."""
    build = outcome.stages["build"]
    return tracking.versions_of_engine(name, tracking.engine_identity(build), build.key)


def _register(registry: RegistrySettings, record: RunSettings, name: str, outcome: CandidateOutcome,
              undo: _Undo) -> str:
    """The one version for this engine's bytes: an existing one (its figures brought up to date), else a new one.

    Reusing keeps an unchanged nightly re-run from piling up identical versions and from
    announcing the engine already in production as a new promotion. Should another process have
    created a version for the same bytes meanwhile (a host outside this lock), the lowest wins.
    """
    found, source = tracking.engine_identity(outcome.stages["build"]), built_from(outcome.stages)
    identity = (({tracking.ENGINE_IDENTITY_TAG: found} if found else {})
                | ({tracking.MODEL_SOURCE_TAG: source} if source else {}))
    same_engine = _same_engine(name, outcome)
    if same_engine:
        if missing := {k: v for k, v in identity.items() if k not in same_engine[0].tags}:  # registered before either
            _refresh_tags(name, same_engine[0].version, missing, undo)
        _refresh_measurement(registry, record, name, same_engine[0], outcome, undo)
        return same_engine[0].version
    tags = {"status": "registered", "decision_reason": outcome.reason[:tracking.MAX_TAG_CHARS],  # from the start
            "candidate": outcome.candidate.name, "precision": outcome.candidate.precision,
            "target": outcome.candidate.target, "cache_key": outcome.cache_key or ""}
    tags |= identity | _metric_tags(outcome) | tracking.measurement(outcome)
    created = tracking.create_version(name, outcome.run_id, tags, description=_version_description(outcome))
    undo.add(f"delete version {created.version} of {name}", lambda: tracking.delete_version(name, created.version))
    killpoints.reach("version.created")
    same_engine = _same_engine(name, outcome)
    lowest = same_engine[0].version if same_engine else created.version
    if lowest != created.version:  # the run that made the lowest may have removed this one already
        tracking.delete_version(name, created.version, missing_ok=True)
        undo.steps.pop()
        _registered_meanwhile(outcome, lowest, created.version)
        return lowest
    holder = tracking.alias_version(name, registry.alias)  # never removed from under a deploy that reads it
    for other in same_engine[1:]:
        if other.version != holder:  # its own run removes it too, whichever of the two comes first
            tracking.delete_version(name, other.version, missing_ok=True)
    return created.version


def _registered_meanwhile(outcome: CandidateOutcome, kept: str, removed: str) -> None:
    """Say that another run (a host outside this lock) registered the same bytes at once, and its version stays."""
    why = (f"another run registered the same engine bytes at the same time as v{kept}; that version is kept "
           f"and v{removed}, made by this run, removed")
    decision = outcome.decision
    outcome.decision = (Decision(why) if decision is None else
                        dataclasses.replace(decision, reason=f"{decision.reason}; {why}"))


def _version_description(outcome: CandidateOutcome, status: str = "registered: passed every gate") -> str:
    """What the registry's version page says first (its tags follow, sorted by name, five at a time): the status,
    the speed, the reason; then whose engine, and when its figures (the tags) were measured."""
    measured = tracking.measurement(outcome)
    return (_headline(status, _metric_tags(outcome), outcome.reason) + f"\n\nEngine of {outcome.candidate.name}."
            + (f" {tracking.measured_sentence(measured)}" if measured else ""))


def _headline(status: str, tags: dict[str, str], reason: str) -> str:
    """`**promoted: holds @champion** · 1.65x PyTorch · p99 30.2 ms`, then the reason on a line of its own."""
    shown = [f"**{status}**"]
    for tag, form in (("speedup_vs_reference", "{}x PyTorch"), ("p99_ms", "p99 {} ms"), ("throughput", "{}/s")):
        with contextlib.suppress(KeyError, ValueError):
            value = float(tags[tag])
            shown.append(form.format(f"{value:.0f}" if abs(value) >= 1e4 else f"{value:.4g}"))
    return " · ".join(shown) + (f"\n\n{reason}" if reason else "")


def _status_words(tags: dict[str, str], alias: str) -> str:
    if tags.get("status") == "superseded":
        return f"superseded by v{tags.get('superseded_by')}"
    if tags.get("status") == "promoted":
        return f"promoted: holds @{alias}"
    return "registered: passed every gate"


def _redescribe(name: str, version: str, status: str, tags: dict[str, str], reason: str, undo: _Undo) -> None:
    """The version's description led by its new status (the lines from `Engine of` on kept), undoably."""
    old = tracking.version_description(name, version)
    rest = old[old.index("Engine of"):] if "Engine of" in old else old
    tracking.set_version_description(name, version, _headline(status, tags, reason) + (f"\n\n{rest}" if rest else ""))
    undo.add(f"restore the description of {name} version {version}",
             lambda: tracking.set_version_description(name, version, old))


def _refresh_measurement(registry: RegistrySettings, record: RunSettings, name: str,
                         version: tracking.RegisteredVersion, outcome: CandidateOutcome, undo: _Undo) -> None:
    """Bring a reused version's metric tags, description and engine card (its key metrics and capacity plan)
    to this run's measurement when it is newer than the one they show: a re-measurement replaced the
    published one (same key, later date)."""
    measured = tracking.measurement(outcome)
    shown = version.tags.get(tracking.MEASURED_AT, "")  # none on a version registered before they were dated
    if not measured.get(tracking.MEASURED_AT) or shown >= measured[tracking.MEASURED_AT]:
        return
    metrics = _metric_tags(outcome)
    stale = [k for k in key_metrics(dict.fromkeys(version.tags, 0.0)) if k not in metrics]  # not measured today
    _refresh_tags(name, version.version, metrics | measured, undo, drop=stale)
    old_description = tracking.version_description(name, version.version)
    tracking.set_version_description(name, version.version,
                                     _version_description(outcome, _status_words(version.tags, registry.alias)))
    undo.add(f"restore the description of {name} version {version.version}",
             lambda: tracking.set_version_description(name, version.version, old_description))
    sections = tracking.measured_sections(record, outcome, stage_metrics(outcome.stages), f"{name} v{version.version}")
    card = tracking.replace_card_sections(version.run_id, sections) if version.run_id != outcome.run_id else None
    if card is not None:
        undo.add(f"restore the engine card of {name} version {version.version}",
                 lambda: tracking.restore_card(version.run_id, card))


def _metric_tags(outcome: CandidateOutcome) -> dict[str, str]:
    return {k: f"{v:.6g}" for k, v in key_metrics(stage_metrics(outcome.stages)).items()}


def _promotion_tags(outcome: CandidateOutcome) -> dict[str, str]:
    """What a version that takes the alias says about it, now: a version getting the alias back is refreshed."""
    reason = outcome.decision.reason if outcome.decision else "promoted"
    return ({"status": "promoted", "decision_reason": reason[:tracking.MAX_TAG_CHARS],
             "promoted_at": datetime.now(UTC).isoformat(), "superseded_by": ""} | _metric_tags(outcome)
            | tracking.measurement(outcome))


def _refresh_tags(name: str, version: str, tags: dict[str, str], undo: _Undo, drop: Sequence[str] = ()) -> None:
    """Set `tags` and delete `drop` on a version, undoably."""
    before = tracking.get_version(name, version).tags

    def restore() -> None:
        for key in [*tags, *drop]:
            if key in before:
                tracking.set_version_tags(name, version, {key: before[key]})
            elif key in tags:
                tracking.delete_version_tag(name, version, key)

    undo.add(f"restore the tags of {name} version {version}", restore)
    tracking.set_version_tags(name, version, tags)
    for key in drop:
        tracking.delete_version_tag(name, version, key)


def _record_event(registry: RegistrySettings, outcome: CandidateOutcome, name: str, version: str, previous: str | None,
                  undo: _Undo) -> None:
    """Append the pending event to the version's outbox (one write) before the alias moves; undoable."""
    metrics = stage_metrics(outcome.stages)
    event = notify.promotion_event(registry, outcome, name, version, metrics, datetime.now(UTC).isoformat())
    before = notify.record_event(name, version, notify.new_record(registry, event, previous))
    undo.add(f"remove the event record of {name} version {version}",
             lambda: notify.restore_events(name, version, before))


def _description(record: RunSettings, target: TargetSpec, alias: str) -> str:
    where = f"{target.backend} on {target.gpu_arch}" if target.gpu_arch else target.backend
    return (f"Engines of pipeline '{record.pipeline}' ({record.model}) for target "
            f"'{target.name}' ({where}). Each version passed every gate; alias "
            f"'{alias}' marks the one in production.")


def _model_tags(record: RunSettings, target: TargetSpec) -> dict[str, str]:
    tags = {"pipeline": record.pipeline, "target": target.name, "backend": target.backend, "model": record.model}
    return tags | ({"arch": target.gpu_arch} if target.gpu_arch else {})
