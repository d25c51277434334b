"""Does the decision see a real difference and ignore a small one? A real engine against itself, slowed down.

Builds one pipeline's engine twice (two identical targets, so two build keys), makes one of them the
champion, and slows one side by a known factor with a wrapper that spins for that fraction of each
call's own time (a real engine doing proportionally more work, not invented samples). Then runs the
benchmark stage and the decision rules as a nightly run would, and prints what they conclude:
  candidate 15% slower -> a conclusive regression, the champion keeps the alias
  candidate  2% slower -> not significant, nothing moves
  candidate 15% faster (the champion slowed) -> takes the alias
Usage: python benchmarks/decision_sensitivity.py [-f pipelines.yaml] [--pipeline minilm] [--precision fp32]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from tasks.backends.base import Runner
from tasks.config.settings import DecisionSettings
from tasks.config.spec import Candidate, load
from tasks.config.stage_settings import BenchmarkConfig, BuildConfig, ExportConfig
from tasks.judge.decide import decide
from tasks.outcome import CandidateOutcome, Champion, GateResult
from tasks.runtime.store import ArtifactStore
from tasks.stages.benchmark import for_candidate, run_benchmark
from tasks.stages.build import open_engine, run_build
from tasks.stages.export import run_export
from tasks.stages.precision import run_precision

CASES = (("15% slower", "candidate", 1 / 0.85), ("2% slower", "candidate", 1.02), ("15% faster", "champion", 1 / 0.85))


class SlowedRunner(Runner):
    """A real engine made `factor` times slower: after each call it spins for (factor - 1) x that call's time."""

    def __init__(self, runner: Runner, factor: float):
        self.runner, self.factor = runner, factor
        self.input_names, self.output_names = runner.input_names, runner.output_names

    def infer(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        start = time.perf_counter()
        outputs = self.runner.infer(feeds)
        until = time.perf_counter() + (time.perf_counter() - start) * (self.factor - 1)
        while time.perf_counter() < until:
            pass
        return outputs

    def close(self) -> None:
        self.runner.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-f", "--file", default="pipelines.yaml")
    parser.add_argument("--pipeline", default="minilm")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--artifacts", default="artifacts")
    args = parser.parse_args()
    spec = load(args.file, check_env=False).pipelines[args.pipeline]
    target = spec.targets[0]
    twin = target.model_copy(update={"name": f"{target.name}-champion"})
    spec = spec.model_copy(update={"targets": [target, twin]})
    store = ArtifactStore(args.artifacts)
    exported = run_export(ExportConfig.of(spec), store)
    precise = run_precision(spec, exported, args.precision, store)
    candidate_build, champion_build = (run_build(BuildConfig.of(spec, t.name, args.precision), precise, store)
                                        for t in (target, twin))
    name = Candidate(spec.name, args.precision, target.name).name
    champion = Champion(f"{spec.name}-{target.name}", "1", "-", champion_build.key, args.precision)
    print(f"{spec.name}/{args.precision}: the same engine as candidate and champion (build keys "
          f"{candidate_build.key} / {champion_build.key}); gate point {spec.gate_point}, "
          f"precision ±{spec.benchmark.precision:.0%}, min_improvement {spec.performance.min_improvement:.0%}")
    for label, slowed, factor in CASES:
        def opener(targets: Any, build: Any, threads: int | None = None, slowed=slowed, factor=factor) -> Runner:
            runner = open_engine(targets, build, threads=threads)
            is_champion = build.key == champion_build.key
            return SlowedRunner(runner, factor) if is_champion == (slowed == "champion") else runner

        with tempfile.TemporaryDirectory() as scratch:
            started = time.perf_counter()
            result = run_benchmark(BenchmarkConfig.of(spec, target.name), {name: candidate_build},
                                   ArtifactStore(Path(scratch)), champion=champion,
                                   champion_build=lambda: champion_build, open_runner=opener)
            seconds = time.perf_counter() - started
        outcome = CandidateOutcome(Candidate(spec.name, args.precision, target.name), "passed",
                                   stages={"build": candidate_build, "benchmark": for_candidate(result, name, champion)},
                                   gates=[GateResult("accuracy", True)])
        decide(DecisionSettings.of(spec), [outcome], {target.name: champion})
        vs = outcome.decision.vs_champion
        print(f"{label:<11} ({slowed} slowed x{factor:.3f}): {vs['ratio']:.3f}x [{vs['ci'][0]:.3f}, {vs['ci'][1]:.3f}] "
              f"in {result.outputs['engines'][name]['gate_point']['rounds']} rounds, {seconds:.0f} s "
              f"(other processes {result.outputs['host']['foreign_cpu_share']:.0%} of the CPU) -> "
              f"{'TAKES THE ALIAS' if outcome.decision.take_alias else 'alias stays'}: {outcome.decision.reason}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
