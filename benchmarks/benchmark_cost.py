"""What the paired-rounds benchmark costs and what it buys, against the fixed-repeats design it replaced.

For one pipeline's target (default minilm/cpu, all its precisions), side by side in one process:
  new:    the benchmark stage at the file's settings (every engine, the reference, in rounds until each
          ratio is within ±benchmark.precision or the point's budget: max_seconds at the gate point,
          survey_seconds elsewhere), timed whole;
  before: per candidate, per shape point, 5 warm-up calls then 30 repeats of engine and reference in
          5 alternating blocks (the stage as it was), timed whole, with its speedup (a ratio of p50s,
          which had no interval).
Both run twice, alternately (new, before, new, before), so a drift in machine load hits both.
Prints the stage seconds of each and, for the new one, each candidate's speedup interval at the gate point.
Usage: python benchmarks/benchmark_cost.py [-f pipelines.yaml] [--pipeline minilm] [--target cpu]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from tasks.config.spec import load
from tasks.config.stage_settings import BenchmarkConfig, BuildConfig, ExportConfig, ModelSource
from tasks.runtime.store import ArtifactStore
from tasks.stages.benchmark import (REFERENCE, benchmark_threads, engine_timer, prefill_past, reference_call,
                             run_benchmark, time_call_ms)
from tasks.stages.build import open_engine, run_build
from tasks.stages.export import run_export
from tasks.stages.inputs import point_feeds, read_texts
from tasks.stages.models import load_reference, load_tokenizer
from tasks.stages.precision import run_precision

LEGACY_WARMUP, LEGACY_REPEATS, LEGACY_BLOCKS = 5, 30, 5


def legacy_seconds(spec, builds: dict, threads: int) -> tuple[float, dict[str, float]]:
    """The fixed-repeats stage: each candidate alone with the reference, blocks alternating."""
    started = time.perf_counter()
    reference, tokenizer = load_reference(ModelSource.of(spec)), load_tokenizer(ModelSource.of(spec))
    texts = read_texts(spec.resolve(spec.accuracy.data))
    speedups = {}
    for name, build in builds.items():
        runner = open_engine(spec.targets, build, threads=threads)
        for batch in spec.benchmark.batch_sizes:
            for seq in spec.benchmark.seq_lens:
                shape = {"batch": batch, "seq": seq, "past": prefill_past(spec.model, spec.profiles)}
                feeds = point_feeds(spec.model, tokenizer, reference, texts, shape, runner.input_names)
                forward = reference_call(reference, feeds, spec.model.task)
                engine, ref = engine_timer(runner, feeds), (lambda n: time_call_ms(forward, 0, n))
                engine(LEGACY_WARMUP), ref(LEGACY_WARMUP)
                engine_ms, reference_ms = [], []
                for _ in range(LEGACY_BLOCKS):
                    engine_ms += engine(LEGACY_REPEATS // LEGACY_BLOCKS)
                    reference_ms += ref(LEGACY_REPEATS // LEGACY_BLOCKS)
                if {"batch": batch, "seq": seq} == spec.gate_point:
                    speedups[name] = statistics.median(reference_ms) / statistics.median(engine_ms)
        runner.close()
    return time.perf_counter() - started, speedups


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-f", "--file", default="pipelines.yaml")
    parser.add_argument("--pipeline", default="minilm")
    parser.add_argument("--target", default="cpu")
    parser.add_argument("--artifacts", default="artifacts")
    args = parser.parse_args()
    spec = load(args.file, check_env=False).pipelines[args.pipeline]
    store = ArtifactStore(args.artifacts)
    exported = run_export(ExportConfig.of(spec), store)
    builds = {f"{spec.name}/{p}/{args.target}": run_build(BuildConfig.of(spec, args.target, p),
                                                           run_precision(spec, exported, p, store), store)
              for p in spec.precisions}
    threads = benchmark_threads(spec.benchmark, getattr(spec.target(args.target), "threads", None))
    torch.set_num_threads(threads)
    print(f"{len(builds)} engines of {spec.name}/{args.target}, {threads} threads, gate point {spec.gate_point}, "
          f"precision ±{spec.benchmark.precision:.0%}, budget {spec.benchmark.max_seconds:.0f} s at the gate point, "
          f"{spec.benchmark.survey_seconds:.0f} s at each other point")
    for attempt in (1, 2):
        with tempfile.TemporaryDirectory() as scratch:
            started = time.perf_counter()
            result = run_benchmark(BenchmarkConfig.of(spec, args.target), builds, ArtifactStore(Path(scratch)))
            new_seconds = time.perf_counter() - started
        before_seconds, before = legacy_seconds(spec, builds, threads)
        host = result.outputs["host"]
        print(f"\nattempt {attempt}: new stage {new_seconds:.1f} s, before {before_seconds:.1f} s "
              f"(other processes used {host['foreign_cpu_share']:.0%} of the CPU during the new one)")
        for name, engine in result.outputs["engines"].items():
            gate = engine["gate_point"]
            low, high = gate["speedup_vs_reference_ci"]
            print(f"  {name:<24} speedup {gate['speedup_vs_reference']:6.3f}x [{low:.3f}, {high:.3f}] "
                  f"±{(high - low) / 2 / gate['speedup_vs_reference']:.1%} in {gate['rounds']} rounds "
                  f"({'conclusive' if gate['speedup_vs_reference_conclusive'] else 'inconclusive'}); "
                  f"before: {before[name]:.3f}x, no interval")
    print(f"\n(the reference, {REFERENCE}, is timed once per round for all engines in the new stage, "
          "and once per candidate before)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
