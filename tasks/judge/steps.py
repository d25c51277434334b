"""The judging steps of a run, each registered once (a `Judge`): what it reads, what it does with it.

They produce no artifact and so have no key: what they decide depends on the registry as it is now, so they
run on every run. tasks/graph.py lays them out after the benchmarks (`judge_steps`), `smelter plan` lists
them, and the flow runs each as a Prefect task named after its stage. smelter's own are JUDGES; another
distribution adds one through an entry point of the `smelter.judges` group that names a `Judge`
(docs/backends.md, "A judging step of your own").
"""

from __future__ import annotations

import dataclasses
import functools
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Literal

from tasks.config.settings import DecisionSettings, GateSettings, RegistrySettings, RunSettings
from tasks.config.spec import PipelineSpec, TargetSpec
from tasks.judge import decide, gates, notify, promote, serving
from tasks.metrics import key_metrics, stage_metrics
from tasks.outcome import CandidateOutcome, Champion
from tasks.registry import tracking
from tasks.runtime.error_text import described
from tasks.stages.accuracy import measured_on

JUDGES_GROUP = "smelter.judges"
Ref = tuple[str, str]
"""(stage, node): one step of a run, e.g. ("gate", "minilm/int8/cpu")."""


@dataclass(frozen=True)
class Judging:
    """What the judging steps read and hand on, in running order. A step returns the next state instead of
    changing this one (Prefect may hand a task a copy of its arguments)."""

    spec: PipelineSpec
    outcomes: list[CandidateOutcome]
    champions: dict[str, Champion | None]
    deliveries: list[dict[str, Any]] = field(default_factory=list)
    failed: frozenset[Ref] = frozenset()  # steps that failed: the steps that read them do not run

    def outcome(self, name: str) -> CandidateOutcome:
        return next(o for o in self.outcomes if o.candidate.name == name)

    def with_outcome(self, outcome: CandidateOutcome) -> Judging:
        outcomes = [outcome if o.candidate.name == outcome.candidate.name else o for o in self.outcomes]
        return dataclasses.replace(self, outcomes=outcomes)


@dataclass(frozen=True)
class Judge:
    """One judging stage.

    Args:
        stage: its name: the graph's step, the Prefect task's and `smelter plan`'s row.
        per: one step for each candidate (node: the candidate) or one for the pipeline (node: its name).
        after: the stages whose steps it reads: a candidate's step reads its own candidate's steps of a
            per-candidate stage and its target's benchmark; a pipeline's step reads every step of them.
        act: runs the step for one node and returns the next state; a failure it handles is recorded on the
            candidates it fails (status, failed_stage, error) and in `failed`, not raised.
        reads: what it decides from, said by `smelter plan`, given where the pipeline registers its engines.
        before: stages that read this one besides those that name it in their `after` (a plugin's extra
            gate goes before smelter's decide).
        applies: whether the pipeline has this step at all, given the targets of its candidates (package: only
            where a target's backend packages).
    """

    stage: str
    per: Literal["candidate", "pipeline"]
    after: tuple[str, ...]
    act: Callable[[Judging, str], Judging]
    reads: Callable[[RegistrySettings], str]
    before: tuple[str, ...] = ()
    applies: Callable[[list[TargetSpec]], bool] = lambda targets: True


def fail(outcome: CandidateOutcome, stage: str, error: BaseException) -> None:
    """Record on the candidate that `stage` failed it (the flow prints the line)."""
    outcome.status = "failed"
    outcome.failed_stage = stage
    outcome.error = f"{stage} failed: {described(error)}"


def _gate(judging: Judging, node: str) -> Judging:
    """Gate (unless a stage failed) a candidate its build logged, against the gates and the previous
    registered version, and record the verdict on its run."""
    outcome = judging.outcome(node)
    if not outcome.run_id:
        return judging
    if outcome.status != "failed":
        spec, candidate = judging.spec, outcome.candidate
        previous = tracking.previous_version(RegistrySettings.of(spec), candidate.target, candidate.precision,
                                             outcome.stages.get("build"), measured_on(outcome.stages.get("accuracy")))
        measured = stage_metrics(outcome.stages)
        outcome.metrics = key_metrics(measured)
        validity = outcome.stages["accuracy"].outputs.get("validity")
        outcome.gates = gates.evaluate(GateSettings.of(spec), measured, validity, previous)
        outcome.status = "passed" if outcome.passed_gates else "rejected"
    try:
        tracking.record_gates(outcome.run_id, outcome)
    except Exception as e:  # noqa: BLE001 - an unrecorded verdict may not be promoted; the others go on
        fail(outcome, "track", e)
    return judging.with_outcome(outcome)


def _decide(judging: Judging, node: str) -> Judging:
    """Each target's champion among the candidates that passed, against the one registered now."""
    outcomes = decide.decide(DecisionSettings.of(judging.spec), judging.outcomes, judging.champions)
    return dataclasses.replace(judging, outcomes=outcomes)


def _promote(judging: Judging, node: str) -> Judging:
    """Move the aliases to the decided champions, all or nothing: a failure rolls promotion back and fails the
    candidates that would have been promoted."""
    try:
        outcomes = promote.promote(RegistrySettings.of(judging.spec), RunSettings.of(judging.spec), judging.outcomes)
        return dataclasses.replace(judging, outcomes=outcomes)
    except Exception as e:  # noqa: BLE001 - promotion rolled back: its candidates failed, the alias did not move
        for outcome in judging.outcomes:
            if outcome.status == "passed":
                fail(outcome, "promote", e)
        return dataclasses.replace(judging, failed=judging.failed | {("promote", node)})


def _after_promotion(judging: Judging, stage: str, error: BaseException) -> Judging:
    """The alias has moved by now: a failure is recorded on the promoted candidates without undoing their
    promotion; an unsent event stays pending for the next run or `smelter notify --retry`."""
    for outcome in judging.outcomes:
        if outcome.status == "promoted":
            outcome.failed_stage = stage
            outcome.error = f"{stage} failed after promotion: {described(error)}"
    return dataclasses.replace(judging, failed=judging.failed | {(stage, judging.spec.name)})


def _package(judging: Judging, node: str) -> Judging:
    """Serving packages of promoted engines (where a target's backend declares one), logged to their runs."""
    try:
        with tempfile.TemporaryDirectory(prefix="smelter-serving-") as tmp:
            outcomes = [_with_engine_here(o, Path(tmp) / "engines") for o in judging.outcomes]
            slo_ms = serving.latency_slo_ms(judging.spec.performance.gates)
            packages = serving.package_promoted(judging.spec.name, slo_ms, outcomes, Path(tmp) / "repository")
            for run_id, model_dir in packages.items():
                tracking.log_directory(run_id, model_dir, f"triton/{model_dir.name}")
    except Exception as e:  # noqa: BLE001 - see _after_promotion
        return _after_promotion(judging, "package", e)
    return judging


def _with_engine_here(outcome: CandidateOutcome, engines: Path) -> CandidateOutcome:
    """A promoted engine built on another host, with its engine downloaded from its run."""
    build = outcome.stages.get("build")
    remote_engine = build is not None and serving.serves(build.outputs) and not build.path.is_dir()
    if outcome.status != "promoted" or not remote_engine:
        return outcome
    here = tracking.engine_dir(outcome, engines / outcome.run_id)
    return dataclasses.replace(outcome, stages=outcome.stages | {"build": dataclasses.replace(build, path=here)})


def _notify(judging: Judging, node: str) -> Judging:
    """The promotions' webhooks, and earlier runs' pending events."""
    try:
        deliveries = notify.notify_promotions(RegistrySettings.of(judging.spec), judging.outcomes)
    except Exception as e:  # noqa: BLE001 - see _after_promotion
        return _after_promotion(judging, "notify", e)
    return dataclasses.replace(judging, deliveries=deliveries)


def _packages(targets: list[TargetSpec]) -> bool:
    """Whether a target's backend packages its promoted engines for serving (TargetSpec.serving)."""
    return any(t.serving is not None for t in targets)


def _webhooks(registry: RegistrySettings) -> str:
    hooks = len(registry.webhooks)
    return f"the promotions and earlier runs' pending events, for {hooks} webhook{'s' * (hooks != 1)}"


JUDGES = (
    Judge("gate", "candidate", ("accuracy", "benchmark"), _gate,
          lambda registry: "accuracy and benchmark against the gates and the previous registered version"),
    Judge("decide", "pipeline", ("gate",), _decide,
          lambda registry: "the gates and each target's registered champion"),
    Judge("promote", "pipeline", ("decide",), _promote,
          lambda registry: f"the decisions and each target's @{registry.alias} in the registry"),
    Judge("package", "pipeline", ("promote",), _package,
          lambda registry: "promoted engines: serving packages (Triton entries of TensorRT plans)", applies=_packages),
    Judge("notify", "pipeline", ("promote",), _notify, _webhooks),
)
"""smelter's own judging stages."""


@functools.cache
def installed() -> tuple[Judge, ...]:
    """smelter's judging stages, then those other distributions register (one whose name is taken, or that
    cannot be loaded, is left out with a warning)."""
    found = {judge.stage: judge for judge in JUDGES}
    for entry in sorted(entry_points(group=JUDGES_GROUP), key=lambda e: e.name):
        dist = entry.dist.name if entry.dist else "?"
        try:
            judge = entry.load()
        except Exception as e:  # noqa: BLE001 - a third-party module may fail in any way
            warnings.warn(f"judging step {entry.name} of {dist} ignored: cannot load {entry.value} ({e})",
                          stacklevel=2)
            continue
        if not isinstance(judge, Judge) or judge.stage in found:
            why = "not a Judge" if not isinstance(judge, Judge) else f"stage {judge.stage!r} exists already"
            warnings.warn(f"judging step {entry.name} of {dist} ignored: {why}", stacklevel=2)
            continue
        found[judge.stage] = judge
    return tuple(found.values())


def reads_of(judges: list[Judge] | tuple[Judge, ...]) -> dict[str, tuple[str, ...]]:
    """Every judging stage's `after`, with the judges that name it in their `before`."""
    reads = {judge.stage: list(judge.after) for judge in judges}
    for judge in judges:
        for later in judge.before:
            if later in reads:
                reads[later].append(judge.stage)
    return {stage: tuple(dict.fromkeys(r)) for stage, r in reads.items()}


def in_running_order(judges: tuple[Judge, ...]) -> list[Judge]:
    """The judges, each after the judging stages it reads, otherwise in registration order."""
    reads = {stage: {s for s in r if s != stage} for stage, r in reads_of(judges).items()}
    ordered: list[Judge] = []
    pending = list(judges)
    while pending:
        ready = next((j for j in pending if not reads[j.stage] & {p.stage for p in pending}), None)
        if ready is None:
            raise ValueError(f"judging stages read each other in a circle: {', '.join(j.stage for j in pending)}")
        ordered.append(ready)
        pending.remove(ready)
    return ordered
