"""Every engine of one target timed side by side with the PyTorch reference and the champion.

One measurement per (pipeline, target): its candidates' engines, eager PyTorch FP32 and, when it is
not one of them, the engine holding the promotion alias are interleaved in rounds (tasks/measure/rounds.py)
on the same feeds, threads and settings. Every ratio a gate or a decision reads (speedup over the
reference, speed against the champion) is then a paired comparison taken in the same seconds, with
its 95% interval (tasks/measure/stats.py), and every percentile is derived from the raw samples kept.

A measurement taken while other processes used the CPU (tasks/measure/hostload.py) is still published when
nothing was, and replaces one already published for the same key only when it is less contended, so
a busy night cannot overwrite a cleaner measurement that later decisions read, and a quieter one is
not thrown away. Contended numbers decide nothing (tasks/judge/gates.py, tasks/judge/decide.py).
"""

from __future__ import annotations

import copy
import itertools
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from tasks.backends.base import Runner
from tasks.config.spec import BenchmarkSpec, ModelSpec, ProfileSpec, at_point
from tasks.config.stage_settings import BenchmarkConfig
from tasks.measure import stats
from tasks.measure.hostload import LoadWatch
from tasks.measure.rounds import Contender, Rounds, measure_rounds
from tasks.outcome import Champion
from tasks.registry.tracking import engine_identity
from tasks.runtime import killpoints
from tasks.runtime.stage_runner import KeepPublished, Work, run_stage
from tasks.runtime.store import ArtifactStore, StageResult, StageWriter, file_digest, host_facts, tool_versions
from tasks.stages.build import open_engine
from tasks.stages.champion import built_from, cannot_run_here, same_engine
from tasks.stages.inputs import PAST_PREFIX, past_cache, past_layers, point_feeds, read_texts
from tasks.stages.models import load_reference, load_tokenizer

if TYPE_CHECKING:
    import torch

SAMPLES = "samples.csv"
PLOT = "latency.png"
REFERENCE = "pytorch-fp32"
TOOLS = ("torch", "transformers", "numpy")
CODE = ("tasks.stages.benchmark", "tasks.measure.rounds", "tasks.measure.stats", "tasks.stages.inputs",
        "tasks.measure.gpu_measure")  # part of the key

OpenRunner = Callable[..., Runner]


@dataclass
class LatencySamples:
    """Raw per-call latencies of one engine at one shape; every statistic is derived from them."""

    samples_ms: list[float]

    def percentile(self, q: float) -> float:
        return float(np.percentile(self.samples_ms, q))

    @property
    def mean_ms(self) -> float:
        return float(np.mean(self.samples_ms))

    def summary(self, batch: int, tokens_per_call: int) -> dict[str, float]:
        """Percentiles, mean, samples/s (batch / median seconds) and tokens/s. Rates divide by the median call,
        as decisions read medians (of paired per-round ratios): a few slow outliers inflate a mean, and a rate
        from it could rank two engines the other way round from the decision."""
        median_s = self.percentile(50) / 1e3
        return {"p50_ms": self.percentile(50), "p90_ms": self.percentile(90), "p99_ms": self.percentile(99),
                "mean_ms": self.mean_ms, "throughput": batch / median_s, "tokens_per_s": tokens_per_call / median_s}


def benchmark_threads(settings: BenchmarkSpec, target_threads: int | None) -> int:
    """One thread count for every engine and the reference: benchmark.threads, else the target's, else all cores."""
    return settings.threads or target_threads or os.cpu_count() or 1


def _settings(config: BenchmarkConfig) -> dict[str, Any]:
    return {"task": config.source.model.task, "benchmark": config.settings.model_dump(mode="json"),
            "gate_point": config.gate_point,
            "threads": benchmark_threads(config.settings, config.target.intra_op_threads), "method": stats.METHOD}


def _extra_champion(champion: Champion | None, builds: dict[str, StageResult]) -> bool:
    """Whether the champion must be measured as an engine of its own (it is none of the candidates)."""
    return champion is not None and not any(same_engine(champion, b) for b in builds.values())


def _uncontended(published: StageResult) -> bool:
    return not published.outputs.get("host", {}).get("contended")


def _busier_than(load: dict[str, Any], published: StageResult) -> bool:
    """Whether a new contended measurement is at least as busy as the published one (then that one stands)."""
    before = published.outputs.get("host", {}).get("foreign_cpu_share")
    return before is None or (load.get("foreign_cpu_share") or 0.0) >= before


def benchmark_work(config: BenchmarkConfig, builds: dict[str, StageResult], champion: Champion | None = None,
                   champion_build: Callable[[], StageResult] | None = None,
                   open_runner: OpenRunner = open_engine) -> Work:
    """One target's engines timed side by side; a published measurement taken under contention is
    measured again, and kept when the new one is at least as contended."""
    pipeline, target_name = config.source.pipeline, config.target.name
    if not builds:
        raise ValueError(f"pipeline {pipeline}, target {target_name}: no built engine to benchmark")
    settings, tools = _settings(config), tool_versions(*TOOLS)
    engines = sorted((name, build.key, build.content) for name, build in builds.items())
    parts = {"target": target_name, "engines": engines,
             "champion": _extra_champion(champion, builds) and (champion.engine_identity or champion.build_key),
             "config": settings,
             "data": file_digest(config.data_path), "host": host_facts(), "tools": tools}

    def produce(w: StageWriter, published: StageResult | None) -> None:
        with LoadWatch(config.settings.contended_above) as load:
            measured = _measure(config, builds, champion, champion_build, settings["threads"], open_runner)
        if published and load.contended and _busier_than(load.as_dict(), published):
            before = published.outputs["host"].get("foreign_cpu_share")
            raise KeepPublished(f"measured again, but other processes used {load.foreign_cpu_share:.0%} of the CPU "
                                f"(the published measurement: {before:.0%}): the published measurement stands"
                                if before is not None else "measured again on a busy machine: the published "
                                "measurement stands")
        w.outputs.update(measured.outputs | {"host": load.as_dict(), "key": w.manifest["key"]})
        measured.samples.to_csv(w.dir / SAMPLES, index=False)
        killpoints.reach("benchmark")
        _plot(measured.samples, w.dir / PLOT)

    inputs = {"builds": {name: b.key for name, b in builds.items()},
              "engines": {name: engine_identity(b) for name, b in builds.items()},
              "champion": champion.build_key if champion else None}
    return Work(pipeline, "benchmark", parts, CODE, produce, inputs=inputs, config=settings, tools=tools,
                reusable=_uncontended)


def run_benchmark(config: BenchmarkConfig, builds: dict[str, StageResult], store: ArtifactStore,
                  champion: Champion | None = None, champion_build: Callable[[], StageResult] | None = None,
                  force: bool = False, open_runner: OpenRunner = open_engine) -> StageResult:
    """Time every engine in `builds` (candidate name -> build output) for one target, side by side.

    `champion_build` fetches the champion's engine when it is not among `builds`; when it cannot
    (gone, corrupt, built for another machine) the measurement records why and goes on without it.
    `open_runner` opens an engine on the target it was built for, given the pipeline's targets (a loader,
    Polygraphy-style); benchmarks pass one that wraps it.
    """
    return run_stage(benchmark_work(config, builds, champion, champion_build, open_runner), store, force)


def for_candidate(result: StageResult, candidate: str, champion: Champion | None = None) -> StageResult:
    """The target's measurement seen from one candidate: its own points with their ratio to the reference
    and, when `champion` was measured (as a candidate or as its own engine), to the champion, plus what
    all share. Every pair of engines was compared in the rounds, so any of them can be the champion."""
    outputs = dict(result.outputs)
    mine = outputs.pop("engines", {}).get(candidate)
    if mine is None:
        raise KeyError(f"benchmark {result.key} did not measure candidate {candidate}")
    outputs["champion"] = info = _champion_info(result, champion)
    label = info["label"] if info else None
    if label is not None and label != candidate:
        comparisons = outputs.get("comparisons", [])
        mine = {key: [row | _vs(comparisons, row, candidate, label) for row in rows]
                for key, rows in mine.items() if key != "gate_point"}
        at = result.outputs["engines"][candidate]["gate_point"]
        mine["gate_point"] = next(row for row in mine["points"] + mine.get("decode", []) if at_point(row, at))
    return replace(result, manifest=result.manifest | {"outputs": outputs | mine})


def _champion_info(result: StageResult, champion: Champion | None) -> dict[str, Any] | None:
    """Which contender is the champion: the candidate with its bytes (its build key, for a measurement or a version
    from before digests were recorded), else its own engine (or why it is absent)."""
    if champion is None:
        return None
    inputs = result.manifest.get("inputs", {})
    identities = inputs.get("engines") or {}
    same = [name for name, key in inputs.get("builds", {}).items()
            if (identities.get(name) == champion.engine_identity if champion.engine_identity and identities.get(name)
                else key == champion.build_key)]
    if same:
        return {"version": champion.version, "registered_model": champion.registered_model,
                "build_key": champion.build_key, "label": same[0], "unavailable": None, "permanent": False}
    return result.outputs.get("champion")


@dataclass
class _Measured:
    outputs: dict[str, Any]
    samples: pd.DataFrame


def _measure(config: BenchmarkConfig, builds: dict[str, StageResult], champion: Champion | None,
             champion_build: Callable[[], StageResult] | None, threads: int, open_runner: OpenRunner) -> _Measured:
    import torch

    texts = read_texts(config.data_path)
    reference = load_reference(config.source)
    device = reference_device(config.target)
    runners: dict[str, Runner] = {}
    champion_info: dict[str, Any] | None = None
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for name, build in builds.items():
            runners[name] = open_runner(config.targets, build, threads=threads)
        if _extra_champion(champion, builds):
            champion_info = {"version": champion.version, "registered_model": champion.registered_model,
                             "build_key": champion.build_key, "label": champion.label, "unavailable": None,
                             "permanent": False, "model_source": None}
            try:
                built = champion_build()
                champion_info["model_source"] = built_from({"build": built})  # retrained since? (tasks/judge/decide.py)
                runners[champion.label] = open_runner(config.targets, built, threads=threads)
            except Exception as e:  # noqa: BLE001 - recorded; the decision reads it
                champion_info |= {"label": None, "unavailable": f"{type(e).__name__}: {e}",
                                  "permanent": cannot_run_here(e)}
        bench = _Bench(config, list(builds), runners, reference, load_tokenizer(config.source), texts, device)
        measured = [(point, bench.measure(point)) for point in _points(config)]
    finally:
        for runner in runners.values():
            runner.close()
        torch.set_num_threads(previous_threads)
    engines = {name: _engine_outputs(config, name, measured) for name in builds}
    notes = [f"{_where(point)}: {rounds.extended}" for point, rounds in measured if rounds.extended]
    outputs = {"engines": engines, "champion": champion_info, "reference": REFERENCE, "reference_device": device,
               "notes": notes,
               "threads": threads, "method": stats.METHOD, "precision": config.settings.precision,
               "comparisons": [row for point, rounds in measured
                               for row in _comparison_rows(point, rounds, config.settings.precision)]}
    return _Measured(outputs, _samples_table(measured))


def _where(point: dict[str, int]) -> str:
    return (f"decode batch {point['batch']} past {point['past']}" if point["decode"]
            else f"batch {point['batch']} seq {point['seq']}")


def _points(config: BenchmarkConfig) -> list[dict[str, int]]:
    """Every prefill (batch, seq) of benchmark:, then decoders' decode step (one new token) per batch."""
    settings = config.settings
    past = prefill_past(config.source.model, config.profiles)
    points = [{"batch": b, "seq": s, "past": past, "decode": 0} for b in settings.batch_sizes
              for s in settings.seq_lens]
    if config.source.model.is_decoder:
        points += [{"batch": b, "seq": 1, "past": settings.past_len, "decode": 1} for b in settings.batch_sizes]
    return points


def point_budget(config: BenchmarkConfig, point: dict[str, int]) -> tuple[float, float]:
    """(fewest, most) seconds one point's rounds take: the gate point, which gates and decisions read,
    spans at least `min_seconds` and gets `max_seconds` to reach ±precision; every other point
    describes the engine and gets `survey_seconds`, stopping as soon as it is conclusive."""
    settings = config.settings
    if at_point(point, config.gate_point):
        return settings.min_seconds, settings.max_seconds
    return 0.0, settings.survey_seconds


def _engine_outputs(config: BenchmarkConfig, name: str,
                    measured: list[tuple[dict[str, int], Rounds]]) -> dict[str, Any]:
    """One candidate's rows: prefill points, decode steps, and the gate point the gates read."""
    points, decode = [], []
    for point, rounds in measured:
        row = _row(point, rounds, name, config.settings.precision)
        (decode if point["decode"] else points).append(row)
    gate = next(row for row in points + decode if at_point(row, config.gate_point))
    return {"points": points, "gate_point": gate} | ({"decode": decode} if config.source.model.is_decoder else {})


def _row(point: dict[str, int], rounds: Rounds, name: str, precision: float) -> dict[str, Any]:
    batch, seq = point["batch"], point["seq"]
    tokens = batch if point["decode"] else batch * seq
    engine = LatencySamples(rounds.calls_ms(name)).summary(batch, tokens)
    reference = LatencySamples(rounds.calls_ms(REFERENCE)).summary(batch, tokens)
    row: dict[str, Any] = {"batch": batch} | ({"past": point["past"]} if point["decode"] else {"seq": seq})
    row |= engine | {f"reference_{k}": v for k, v in reference.items()}
    row |= _ratio_fields("speedup_vs_reference", rounds.ratio(REFERENCE, name), precision)
    return row | {"rounds": rounds.count, "seconds": round(rounds.seconds, 3)}


def _ratio_fields(prefix: str, ratio: stats.Ratio, precision: float) -> dict[str, Any]:
    return {prefix: ratio.ratio, f"{prefix}_ci": [ratio.low, ratio.high],
            f"{prefix}_conclusive": ratio.conclusive(precision)}


def _comparison_rows(point: dict[str, int], rounds: Rounds, precision: float) -> list[dict[str, Any]]:
    """Every ratio measured at one point: `engine` is `ratio` times as fast as `versus` (the MLflow comparison table)."""
    rows = []
    for baseline, contender in rounds.pairs:
        ratio = rounds.ratio(baseline, contender)
        rows.append({"step": "decode" if point["decode"] else "prefill", "batch": point["batch"], "seq": point["seq"],
                     "past": point["past"], "engine": contender, "versus": baseline, "ratio": ratio.ratio,
                     "ci_low": ratio.low, "ci_high": ratio.high, "half_width": ratio.half_width,
                     "rounds": ratio.rounds, "conclusive": ratio.conclusive(precision)})
    return rows


def _vs(comparisons: list[dict[str, Any]], row: dict[str, Any], name: str, baseline: str) -> dict[str, Any]:
    """`name` against `baseline` at the point of `row`, read either way round from the comparison table."""
    for found in comparisons:
        if not at_point(found, row):
            continue
        if (found["engine"], found["versus"]) == (name, baseline):
            ratio, low, high = found["ratio"], found["ci_low"], found["ci_high"]
        elif (found["engine"], found["versus"]) == (baseline, name):
            ratio, low, high = 1 / found["ratio"], 1 / found["ci_high"], 1 / found["ci_low"]
        else:
            continue
        return {"vs_champion": ratio, "vs_champion_ci": [low, high], "vs_champion_conclusive": found["conclusive"]}
    return {}


def reference_device(target: Any) -> str:
    """Where eager PyTorch runs: on the GPU beside a GPU target's engines when it can, so ratios compare like with like."""
    import torch

    return "cuda" if target.device_kind == "gpu" and torch.cuda.is_available() else "cpu"


def prefill_past(model: ModelSpec, profiles: Sequence[ProfileSpec]) -> int:
    """Prefill runs on an empty cache, or on the shortest past the engine's profiles accept (a KV graph needs one)."""
    return min(p.past[0] for p in profiles) if model.has_past else 0


def fed_shape(model: ModelSpec, batch: int, seq: int, past: int) -> dict[str, int]:
    """The shape an engine is fed for `seq` new tokens after `past`: without a KV cache a decode step re-reads the
    whole prefix (past + 1 tokens, no cache)."""
    if past and not model.has_past:
        seq, past = past + 1, 0
    return {"batch": batch, "seq": seq, "past": past}


class _Bench:
    """Feeds and timed calls for the engines and the reference at one shape point."""

    def __init__(self, config: BenchmarkConfig, candidates: list[str], runners: dict[str, Runner],
                 reference: torch.nn.Module, tokenizer: Any, texts: list[str], device: str):
        self.config, self.model, self.candidates, self.runners = config, config.source.model, candidates, runners
        self.reference, self.tokenizer, self.texts = reference, tokenizer, texts
        self.device = device
        self.timed_reference = reference if device == "cpu" else copy.deepcopy(reference).to(device)
        self.input_names = sorted({name for runner in runners.values() for name in runner.input_names})

    def feeds(self, batch: int, seq: int, past: int) -> dict[str, np.ndarray]:
        shape = fed_shape(self.model, batch, seq, past)
        return point_feeds(self.model, self.tokenizer, self.reference, self.texts, shape, self.input_names)

    def measure(self, point: dict[str, int]) -> Rounds:
        """Every engine against the reference, every candidate against each other and against an extra champion."""
        feeds = self.feeds(point["batch"], point["seq"], point["past"])
        forward = reference_call(self.timed_reference, feeds, self.model.task, self.device)
        contenders = [Contender(REFERENCE, reference_timer(forward, self.device))]
        contenders += [Contender(name, engine_timer(runner, feeds)) for name, runner in self.runners.items()]
        pairs = [(REFERENCE, name) for name in self.candidates]
        pairs += list(itertools.combinations(self.candidates, 2))
        pairs += [(extra, name) for extra in self.runners if extra not in self.candidates for name in self.candidates]
        settings = self.config.settings
        fewest, most = point_budget(self.config, point)
        return measure_rounds(contenders, pairs, warmup=settings.warmup, min_rounds=settings.min_rounds,
                              max_seconds=most, precision=settings.precision, min_seconds=fewest)


def engine_timer(runner: Runner, feeds: dict[str, np.ndarray]) -> Callable[[int], list[float]]:
    return lambda n: runner.time_ms(feeds, 0, n)


def reference_timer(forward: Callable[[], Any], device: str) -> Callable[[int], list[float]]:
    """On a GPU the reference is timed like GPU engines are: CUDA events, inputs and outputs on the device."""
    if device == "cpu":
        return lambda n: time_call_ms(forward, 0, n)
    from tasks.measure.gpu_measure import cuda_times_ms

    return lambda n: cuda_times_ms(forward, 0, n)


def time_call_ms(call: Callable[[], Any], warmup: int, repeats: int) -> list[float]:
    for _ in range(warmup):
        call()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        samples.append((time.perf_counter() - start) * 1e3)
    return samples


def reference_call(model: torch.nn.Module, feeds: dict[str, np.ndarray], task: str,
                   device: str = "cpu") -> Callable[[], Any]:
    """The eager forward for these feeds; a decoder's KV cache is rebuilt per call since forward extends it.

    On a GPU each call waits for the device, so host timing measures the work, not the launch.
    """
    import torch

    tensors = {name: torch.from_numpy(value).to(device) for name, value in feeds.items()
               if not name.startswith(PAST_PREFIX)}
    layers = past_layers(feeds, device)

    @torch.inference_mode()
    def forward() -> Any:
        if task == "text-generation-with-past":
            return model(**tensors, past_key_values=past_cache(layers), use_cache=True)
        if task == "text-generation":
            return model(**tensors, use_cache=False)
        return model(**tensors)

    def call() -> Any:
        outputs = forward()
        if device != "cpu":
            torch.cuda.synchronize()
        return outputs

    return call


def _samples_table(measured: list[tuple[dict[str, int], Rounds]]) -> pd.DataFrame:
    rows = [{"engine": name, "batch": point["batch"], "seq": point["seq"], "past": point["past"],
             "step": "decode" if point["decode"] else "prefill", "round": r, "call": c, "ms": ms}
            for point, rounds in measured for name in rounds.names
            for r, slot in enumerate(rounds.samples_ms[name]) for c, ms in enumerate(slot)]
    return pd.DataFrame(rows, columns=["engine", "batch", "seq", "past", "step", "round", "call", "ms"])


def _plot(samples: pd.DataFrame, path: Path) -> None:
    """Box plots of the raw samples, one box per engine, grouped by shape point."""
    from matplotlib.figure import Figure

    groups = list(samples.groupby(["step", "batch", "seq", "past"], sort=False))
    engines = list(dict.fromkeys(samples["engine"]))
    fig = Figure(figsize=(max(6.0, 1.2 * len(groups) * len(engines)), 4.0))
    ax = fig.subplots()
    width = 0.8 / len(engines)
    colours = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:gray"]
    for i, engine in enumerate(engines):
        data = [g[g["engine"] == engine]["ms"].to_numpy() for _, g in groups]
        positions = np.arange(len(groups)) + (i - (len(engines) - 1) / 2) * width
        boxes = ax.boxplot([d if d.size else [np.nan] for d in data], positions=positions, widths=width * 0.9,
                           patch_artist=True, showfliers=True)
        for box in boxes["boxes"]:
            box.set_facecolor(colours[i % len(colours)])
        boxes["boxes"][0].set_label(engine)
    ax.set_xticks(np.arange(len(groups)),
                  [f"{step} b{b} s{s}" + (f" p{p}" if p else "") for (step, b, s, p), _ in groups])
    ax.set_yscale("log")
    ax.set_ylabel("latency (ms)")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
