"""A/A test: one ONNX Runtime engine timed against itself, the stage's way. How often is it called different?

Two sessions of the same small ONNX graph (a 4-layer MLP made here) are the two contenders of
tasks/measure/rounds.py's interleaved rounds, with the benchmark stage's defaults (warm-up, min_rounds,
budget, precision) and tasks/measure/stats.py's ratio and 95% interval, watched by tasks/measure/hostload.py as the
stage watches it. The true ratio is 1, so per repeat:
- covered: the interval contains 1 (the bar: in ≥ 90% of repeats);
- conclusive and wrong: the interval is within ±precision and excludes 1 (the bar: ≤ 5%), split into
  quiet repeats (which could decide) and contended ones (which decide nothing, tasks/judge/decide.py);
- contended: other processes used more than `contended_above` of the CPU while it was timed;
- would move the alias: conclusive, the interval above 1 and the ratio ≥ 1 + performance.min_improvement
  (either way round), on a quiet machine: the error a user would see.
It runs the repeats on a quiet machine, then again while `--busy` processes spin.

    .venv/bin/python benchmarks/aa_test.py                        # 5 + 5 repeats, about 1 minute
    .venv/bin/python benchmarks/aa_test.py --repeats 20 --busy 2  # the issue's figures, about 4 minutes
"""

from __future__ import annotations

import argparse
import multiprocessing
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tasks.config.spec import BenchmarkSpec, PerformanceSpec
from tasks.measure.hostload import LoadWatch
from tasks.measure.rounds import Contender, measure_rounds
from tasks.measure.stats import Ratio, wilson_interval

WIDTH = 256


def make_model(path: Path) -> Path:
    """y = relu(relu(relu(x W1) W2) W3) W4, dynamic batch: a few hundred microseconds a call at batch 8."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    nodes, weights, last = [], [], "x"
    for layer in range(4):
        weights.append(numpy_helper.from_array(
            (rng.standard_normal((WIDTH, WIDTH)) / np.sqrt(WIDTH)).astype(np.float32), f"w{layer}"))
        nodes.append(helper.make_node("MatMul", [last, f"w{layer}"], [f"m{layer}"]))
        nodes.append(helper.make_node("Relu", [f"m{layer}"], [f"h{layer}"]))
        last = f"h{layer}"
    graph = helper.make_graph(nodes, "aa", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", WIDTH])],
                              [helper.make_tensor_value_info(last, TensorProto.FLOAT, ["batch", WIDTH])], weights)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def engine_timer(path: Path, threads: int, batch: int):
    """An ONNX Runtime session timed call by call, as the stage's runners time an engine (Runner.time_ms)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    feeds = {"x": np.random.default_rng(1).standard_normal((batch, WIDTH)).astype(np.float32)}

    def timer(n: int) -> list[float]:
        samples = []
        for _ in range(n):
            start = time.perf_counter()
            session.run(None, feeds)
            samples.append((time.perf_counter() - start) * 1e3)
        return samples

    return timer


def _spin() -> None:
    while True:
        pass


@dataclass
class Repeat:
    ratio: Ratio
    contended: bool
    share: float

    @property
    def covered(self) -> bool:
        return not self.ratio.excludes(1.0)


def run_repeats(path: Path, repeats: int, settings: BenchmarkSpec, threads: int, batch: int,
                label: str) -> list[Repeat]:
    """`repeats` A/A measurements, each with fresh sessions (as each run opens its engines anew)."""
    done = []
    for index in range(repeats):
        contenders = [Contender(name, engine_timer(path, threads, batch)) for name in ("a", "b")]
        with LoadWatch(settings.contended_above) as load:
            rounds = measure_rounds(contenders, [("a", "b")], warmup=settings.warmup, min_rounds=settings.min_rounds,
                                    max_seconds=settings.max_seconds, precision=settings.precision)
        ratio = rounds.ratio("a", "b")
        repeat = Repeat(ratio, load.contended, load.foreign_cpu_share or 0.0)
        done.append(repeat)
        verdict = ("conclusive" if ratio.conclusive(settings.precision) else "inconclusive") + \
                  ("" if repeat.covered else ", excludes 1")
        print(f"{label} #{index + 1:>2}: {ratio.text()} ({ratio.rounds} rounds, {rounds.seconds:.1f}s)  {verdict}; "
              f"others used {repeat.share:.0%} of the CPU{' (contended)' if repeat.contended else ''}", flush=True)
    return done


def summary(label: str, done: list[Repeat], precision: float, min_improvement: float) -> str:
    n = len(done)
    covered = sum(r.covered for r in done)
    wrong = [r for r in done if r.ratio.conclusive(precision) and not r.covered]
    wrong_quiet = [r for r in wrong if not r.contended]
    worst = max((max(r.ratio.ratio, 1 / r.ratio.ratio) for r in wrong), default=1.0)
    moves = sum(max(r.ratio.ratio, 1 / r.ratio.ratio) >= 1 + min_improvement for r in wrong_quiet)
    contended = sum(r.contended for r in done)
    low, high = wilson_interval(covered, n)
    shares = sorted(r.share for r in done)
    return (f"{label}: interval contains 1 in {covered}/{n} ({covered / n:.0%}, 95% CI {low:.0%}-{high:.0%}); "
            f"conclusive and wrong in {len(wrong)}/{n} ({len(wrong) / n:.0%}, largest {worst:.3g}x), of which quiet "
            f"(could decide) {len(wrong_quiet)}, would move the alias {moves}; contended {contended}/{n}; others' "
            f"CPU share median {shares[n // 2]:.0%} [{shares[0]:.0%}, {shares[-1]:.0%}]")


def main() -> None:
    defaults = BenchmarkSpec()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="repeats per condition (quiet, busy)")
    parser.add_argument("--busy", type=int, default=2, help="processes spinning during the busy repeats (0: none)")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads of each session")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=defaults.max_seconds / 8,
                        help="max_seconds of each measurement (the stage's default is %(default)s x 8)")
    args = parser.parse_args()
    if args.repeats < 1 or args.busy < 0 or args.threads < 1 or args.batch < 1 or args.seconds <= 0:
        parser.error("--repeats, --threads and --batch must be ≥ 1, --busy ≥ 0 and --seconds > 0")
    settings = defaults.model_copy(update={"max_seconds": args.seconds})
    print(f"A/A: one engine against itself; warmup {settings.warmup}, min_rounds {settings.min_rounds}, "
          f"max_seconds {settings.max_seconds:g}, precision ±{settings.precision:.0%}, contended above "
          f"{settings.contended_above:.0%}; {args.threads} thread(s), batch {args.batch}")
    with tempfile.TemporaryDirectory(prefix="smelter-aa-") as tmp:
        path = make_model(Path(tmp) / "mlp.onnx")
        results = {"quiet": run_repeats(path, args.repeats, settings, args.threads, args.batch, "quiet")}
        if args.busy:
            spinners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(args.busy)]
            for spinner in spinners:
                spinner.start()
            try:
                results[f"busy x{args.busy}"] = run_repeats(path, args.repeats, settings, args.threads, args.batch,
                                                            f"busy x{args.busy}")
            finally:
                for spinner in spinners:
                    spinner.terminate()
                    spinner.join()
    for label, done in results.items():
        print(summary(label, done, settings.precision, PerformanceSpec().min_improvement))


if __name__ == "__main__":
    main()
