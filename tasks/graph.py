"""The stage graph of one pipeline, written once: the flow runs it and `smelter plan` reads it.

A candidate's chain depends on where its backend builds from (tasks/backends/table.py): an
`onnx` backend builds from the precision stage's graph, so its chain is export → validate →
precision → build → accuracy; a `torch` backend (Inductor) builds from the model's own files, so
its chain is build → accuracy. A target's benchmark then measures all its built candidates.

Then the judging steps (tasks/judge/steps.py, each registered once), laid out by what they read: each
candidate's gate (its accuracy and its target's benchmark, against the previous registered version), the
pipeline's decide (every gate: each target's champion among its candidates), promote (the aliases move),
package (serving packages of promoted engines, where a target's backend declares one) and notify
(the promotions' webhooks), with any judging stage another distribution registers in its place.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tasks.backends.base import BackendUnavailable, get_backend
from tasks.backends.table import BACKENDS
from tasks.config.settings import RegistrySettings
from tasks.config.spec import Candidate, PipelineSpec, TargetSpec
from tasks.config.stage_settings import (AccuracyConfig, BenchmarkConfig, BuildConfig, ExportConfig,
                                         ValidateConfig)
from tasks.judge import steps as judging
from tasks.judge.steps import Judging, Ref
from tasks.outcome import Champion
from tasks.runtime.stage_runner import Work
from tasks.runtime.store import ArtifactStore, StageResult
from tasks.stages import accuracy, benchmark, build, export, precision, validate

@dataclass(frozen=True)
class Step:
    """One node of the graph.

    Args:
        stage: the stage it runs.
        node: what it is for (pipeline, pipeline/precision, candidate or pipeline/target).
        needs: the outputs (or judging steps) it is computed from, in the order `work` takes them.
        work: the stage's description of this output, given the outputs it needs; None for a judging step.
        target: the target it runs for (build, accuracy, benchmark, gate), whose backend may be missing here.
        judge: a judging step's action (tasks/judge/steps.py), which produces no artifact and runs every time.
        reads: for a judging step, what it decides from (shown by `smelter plan`).
    """

    stage: str
    node: str
    needs: tuple[Ref, ...]
    work: Callable[..., Work] | None
    target: str | None = None
    judge: Callable[[Judging, str], Judging] | None = None
    reads: str = ""

    @property
    def judges(self) -> bool:
        return self.judge is not None

    @property
    def ref(self) -> Ref:
        return self.stage, self.node


def builds_from_torch(target: TargetSpec) -> bool:
    return BACKENDS[target.backend].source == "torch"


def candidate_steps(spec: PipelineSpec, candidate: Candidate, store: ArtifactStore | None = None) -> list[Step]:
    """The steps that make one candidate's engine and judge its accuracy, in running order.

    Order also gates: a step runs only when every step before it succeeded (a failed validate
    stops the ONNX chain before any precision or engine is made from a wrong export).
    """
    p, t, label = candidate.precision, candidate.target, candidate.name
    judged = functools.partial(Step, "accuracy", label, target=t,
                               work=lambda b: accuracy.accuracy_work(AccuracyConfig.of(spec), b, store))
    if builds_from_torch(spec.target(t)):
        built = Step("build", label, (), lambda: build.build_work(BuildConfig.of(spec, t, p), None), target=t)
        return [built, judged((built.ref,))]
    exported = Step("export", spec.name, (), lambda: export.export_work(ExportConfig.of(spec)))
    validated = Step("validate", spec.name, (exported.ref,),
                     lambda e: validate.validate_work(ValidateConfig.of(spec), e))
    precise = Step("precision", f"{spec.name}/{p}", (exported.ref, validated.ref),
                   lambda e, _validated: precision.precision_work(precision.PrecisionConfig.of(spec, p), e))
    built = Step("build", label, (precise.ref,), lambda r: build.build_work(BuildConfig.of(spec, t, p), r),
                 target=t)
    return [exported, validated, precise, built, judged((built.ref,))]


def benchmark_step(spec: PipelineSpec, target: str, candidates: list[str], champion: Champion | None,
                   champion_build: Callable[[], StageResult] | None = None) -> Step:
    """The target's side-by-side measurement of its built candidates (named by candidate) and the champion."""
    needs = tuple(("build", name) for name in candidates)

    def work(*builds: StageResult) -> Work:
        return benchmark.benchmark_work(BenchmarkConfig.of(spec, target), dict(zip(candidates, builds)),
                                        champion, champion_build)

    return Step("benchmark", f"{spec.name}/{target}", needs, work, target=target)


def pipeline_steps(spec: PipelineSpec, candidates: list[Candidate],
                   champions: dict[str, Champion | None] | None = None) -> list[Step]:
    """Every step of a run over `candidates`, each once, in running order (what `smelter plan` lists)."""
    champions = champions or {}
    steps: dict[Ref, Step] = {}
    for candidate in candidates:
        for step in candidate_steps(spec, candidate):
            steps.setdefault(step.ref, step)
    for target in dict.fromkeys(c.target for c in candidates):
        names = [c.name for c in candidates if c.target == target]
        step = benchmark_step(spec, target, names, champions.get(target))
        steps[step.ref] = step
    return [*steps.values(), *judge_steps(spec, candidates)]


def judge_steps(spec: PipelineSpec, candidates: list[Candidate]) -> list[Step]:
    """The steps that judge the measured candidates and act on the verdict, in running order: every installed
    judging stage that applies, one step per candidate or one for the pipeline, after the steps it reads."""
    targets = [spec.target(t) for t in dict.fromkeys(c.target for c in candidates)]
    judges = [j for j in judging.in_running_order(judging.installed()) if j.applies(targets)]
    registry = RegistrySettings.of(spec)
    reads = judging.reads_of(judges)
    per = {"accuracy": "candidate", "benchmark": "target"} | {j.stage: j.per for j in judges}

    def refs(stage: str, of: list[Candidate]) -> list[Ref]:
        if per.get(stage) == "candidate":
            return [(stage, c.name) for c in of]
        if per.get(stage) == "target":
            return [(stage, f"{spec.name}/{t}") for t in dict.fromkeys(c.target for c in of)]
        return [(stage, spec.name)] if stage in per else []  # a stage that does not apply here: nothing to read

    laid = []
    for judge in judges:
        nodes = [(c.name, [c], c.target) for c in candidates] if judge.per == "candidate" else \
            [(spec.name, candidates, None)]
        laid += [Step(judge.stage, node, tuple(ref for stage in reads[judge.stage] for ref in refs(stage, of)), None,
                      target, judge.act, judge.reads(registry)) for node, of, target in nodes]
    return laid


def unavailable(target: TargetSpec) -> str | None:
    """Why this machine cannot build or run the target's engines (its backend absent, wrong GPU), or None."""
    try:
        return get_backend(target.backend).missing(target)
    except BackendUnavailable as e:
        return str(e)


def call_work(step: Step, outputs: dict[Ref, Any]) -> Work:
    """The step's Work from the outputs it needs (all present)."""
    assert step.work is not None, f"{step.stage} judges: it has no Work"
    return step.work(*(outputs[ref] for ref in step.needs))
