"""`smelter compare`: two registered engines timed side by side on this machine, for a user who doubts a decision.

The same interleaved rounds and interval as the benchmark stage (tasks/measure/rounds.py, tasks/measure/stats.py),
on the pipeline's own evaluation text at one shape point; no reference, no decision, nothing written
to the registry. As in a run, an interval taken while other processes used the CPU is never
conclusive: `contended` says so, with how busy the machine was.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.config.spec import PipelinesFile, SpecError, is_decode_point, point_words, registered_model_name
from tasks.config.stage_settings import BenchmarkConfig
from tasks.measure.hostload import LoadWatch
from tasks.measure.rounds import Contender, measure_rounds
from tasks.measure.stats import METHOD, MIN_ROUNDS, Ratio
from tasks.registry import tracking
from tasks.runtime.store import ArtifactStore
from tasks.stages.benchmark import benchmark_threads, engine_timer, fed_shape, prefill_past
from tasks.stages.build import open_engine
from tasks.stages.champion import champion_build
from tasks.stages.inputs import point_feeds, read_texts
from tasks.stages.models import load_reference, load_tokenizer


@dataclass(frozen=True)
class ComparedModel:
    """A registered model of the file, with what timing its versions reads: the benchmark settings of its target."""

    config: BenchmarkConfig
    file: Path  # the pipelines file that says so, for messages

    @property
    def name(self) -> str:
        return registered_model_name(self.config.source.pipeline, self.config.target.name)


def find_registered_model(specs: PipelinesFile, registered_model: str) -> ComparedModel:
    """The (pipeline, target) whose registered model this is; a name no pipeline owns is a usage error."""
    owners = [ComparedModel(BenchmarkConfig.of(spec, t.name), specs.path) for spec in specs.pipelines.values()
              for t in spec.targets if registered_model_name(spec.name, t.name) == registered_model]
    if not owners:
        known = sorted(registered_model_name(s.name, t.name) for s in specs.pipelines.values() for t in s.targets)
        raise SpecError([f"{specs.path}: compare {registered_model}: no pipeline and target of this file register "
                         f"that model; they register {', '.join(known)}"])
    return owners[0]


def compare_versions(owner: ComparedModel, version_a: str, version_b: str, store: ArtifactStore,
                     batch: int | None = None, seq: int | None = None) -> dict[str, Any]:
    """How many times faster version_b is than version_a at (batch, seq), or at the gate point's decode step when it
    is one and no seq is given, with its 95% interval."""
    config, name = owner.config, owner.name
    step, point = compared_point(config, batch, seq)
    _check_inside_profiles(owner, point)
    threads = benchmark_threads(config.settings, config.target.intra_op_threads)
    builds = {}  # labelled a and b, so a version compared with itself (the noise floor) is timed twice
    for label, version in (("a", version_a), ("b", version_b)):
        found = tracking.find_version(name, version)
        if found is None:
            where = tracking.shown_uri(tracking.tracking_uri())
            if not tracking.registered_model_exists(name):
                raise SpecError([f"compare: {name} is not a registered model in the registry at {where} (a "
                                 f"pipeline's model is registered when one of its candidates first passes every gate)"])
            raise SpecError([f"compare: {name} has no version {version!r} in the registry at {where}"])
        builds[label] = champion_build(config.source.pipeline, tracking.as_champion(name, found), store)
    runners = {label: open_engine(config.targets, build, threads=threads) for label, build in builds.items()}
    try:
        names = sorted({n for r in runners.values() for n in r.input_names})
        feeds = point_feeds(config.source.model, load_tokenizer(config.source), load_reference(config.source),
                            read_texts(config.data_path), point, names)
        settings = config.settings
        with LoadWatch(settings.contended_above) as load:
            rounds = measure_rounds([Contender(label, engine_timer(runner, feeds)) for label, runner in runners.items()],
                                    [("a", "b")], warmup=settings.warmup, min_rounds=settings.min_rounds,
                                    max_seconds=settings.max_seconds, precision=settings.precision,
                                    min_seconds=settings.min_seconds)
    finally:
        for runner in runners.values():
            runner.close()
    ratio = rounds.ratio("a", "b")
    return {"registered_model": name, "a": version_a, "b": version_b, "at": point_words(step), **step,
            "ratio": ratio.ratio, "ci": [ratio.low, ratio.high], "half_width": ratio.half_width,
            "conclusive": ratio.conclusive(settings.precision) and not load.contended and version_a != version_b,
            "contended": load.contended, "same_engine": version_a == version_b,  # the noise floor, never a verdict
            "verdict": "same engine: the noise floor" if version_a == version_b
            else verdict(ratio, settings.precision, load.as_dict()), "rounds": ratio.rounds,
            "seconds": round(rounds.seconds, 2), "extended": rounds.extended, "method": METHOD,
            "host": load.as_dict()}


def compared_point(config: BenchmarkConfig, batch: int | None, seq: int | None
                   ) -> tuple[dict[str, int], dict[str, int]]:
    """(the point as the user names it, the shape the engines are fed): a prefill of `seq` tokens, else the gate
    point, which for a decoder may be a decode step ({batch, past}: one new token after `past`)."""
    at, model = config.gate_point, config.source.model
    if seq is None and is_decode_point(at):
        step = {"batch": batch or at["batch"], "past": at["past"]}
        return step, fed_shape(model, step["batch"], 1, step["past"])
    step = {"batch": batch or at["batch"], "seq": seq or at["seq"]}
    return step, step | {"past": prefill_past(model, config.profiles)}


def _check_inside_profiles(owner: ComparedModel, point: dict[str, int]) -> None:
    """A shape no profile of the pipeline holds is refused before any engine loads: an engine asked to run
    outside its profiles fails, or (beyond the model's positions) runs the machine out of memory trying."""
    profiles, pipeline = owner.config.profiles, owner.config.source.pipeline

    def dims(profile: Any) -> list[str]:
        return [dim for dim in ("batch", "seq", "past") if getattr(profile, dim) is not None and dim in point]

    def holds(profile: Any) -> bool:
        return all(getattr(profile, dim)[0] <= point[dim] <= getattr(profile, dim)[2] for dim in dims(profile))

    if not any(holds(p) for p in profiles):
        ranges = "; ".join(" x ".join(f"{dim} {getattr(p, dim)[0]}-{getattr(p, dim)[2]}" for dim in dims(p))
                           for p in profiles)
        shown = " x ".join(f"{dim} {point[dim]}" for dim in dict.fromkeys(d for p in profiles for d in dims(p)))
        raise SpecError([f"{owner.file}: compare at {shown}: outside every profile of pipeline {pipeline} "
                         f"({ranges}); pick --batch and --seq inside one"])


def verdict(ratio: Ratio, precision: float, host: dict[str, Any]) -> str:
    """One word and why: a busy machine makes any interval inconclusive, as it does in a run."""
    if host.get("contended"):
        return f"inconclusive: machine busy (other processes used {host['foreign_cpu_share']:.0%} of the CPU)"
    if ratio.rounds < MIN_ROUNDS:
        return f"inconclusive: {ratio.rounds} rounds give no 95% interval (at least {MIN_ROUNDS})"
    if not ratio.conclusive(precision):
        return f"inconclusive: ±{ratio.half_width:.1%} is wider than benchmark.precision ±{precision:.0%}"
    return "conclusive"
