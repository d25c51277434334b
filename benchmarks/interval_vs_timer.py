"""Do the stage's in-run intervals agree with an independent timer on real engines?

Three engine pairs of a small BERT made here (random weights, 4 layers x 256 wide), as ONNX Runtime
sessions: fp32 vs dynamic int8, fp32 vs fp32 with graph optimisations off, int8 vs fp32 at batch 1.
Each repeat times a pair twice, one method after the other:
- the stage's way: tasks/measure.py rounds (slot order, untimed round, rounds spanning at least
  `--min-seconds`, early stop at ±precision) and the tasks/stats.py ratio with its 95% interval;
- independently: a plain timeit loop of its own (blocks of ~25 ms of calls after two untimed ones, the
  engines' blocks alternating ABBA; per block the median call, or with `--statistic mean` the mean one),
  the median of the block-pair ratios with a moving-block bootstrap 95% interval over the pairs.
It prints, per repeat, both ratios and whether each point estimate lies inside the other's interval.

    .venv/bin/python benchmarks/interval_vs_timer.py              # about 3 minutes
    .venv/bin/python benchmarks/interval_vs_timer.py --repeats 10 --threads 1 --min-seconds 3 --seconds 6
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from tasks.measure import Contender, measure_rounds
from tasks.spec import BenchmarkSpec
from tasks.stats import paired_ratio

BLOCK_MS = 25.0  # the independent timer's block, like a slot


def make_models(directory: Path) -> dict[str, Path]:
    """fp32 and dynamic-int8 ONNX graphs of a small random BERT encoder."""
    import torch
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(vocab_size=4000, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                        intermediate_size=1024, max_position_embeddings=256)
    model = BertModel(config).eval()
    ids = torch.randint(0, 4000, (1, 64))
    fp32, int8 = directory / "fp32.onnx", directory / "int8.onnx"
    torch.onnx.export(model, (ids, torch.ones_like(ids)), fp32, input_names=["input_ids", "attention_mask"],
                      output_names=["last_hidden_state"], dynamic_axes={"input_ids": {0: "b", 1: "s"},
                                                                        "attention_mask": {0: "b", 1: "s"}},
                      opset_version=17, dynamo=False)
    quantize_dynamic(str(fp32), str(int8), weight_type=QuantType.QInt8)
    return {"fp32": fp32, "int8": int8}


def session_call(path: Path, threads: int, optimise: bool, batch: int, seq: int):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.graph_optimization_level = (ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimise
                                        else ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(1)
    feeds = {"input_ids": rng.integers(0, 4000, (batch, seq)).astype(np.int64),
             "attention_mask": np.ones((batch, seq), dtype=np.int64)}
    return lambda: session.run(None, feeds)


def call_timer(call):
    """Times n calls; the stage's engine timers (Runner.time_ms) do exactly this."""
    def timer(n: int) -> list[float]:
        samples = []
        for _ in range(n):
            start = time.perf_counter()
            call()
            samples.append((time.perf_counter() - start) * 1e3)
        return samples
    return timer


def moving_blocks(n: int, rng: np.random.Generator, resamples: int = 2000) -> np.ndarray:
    """Indices of `resamples` moving-block bootstrap samples of n serial values, blocks of about n^(1/3)."""
    length = max(1, round(n ** (1 / 3)))
    starts = rng.integers(0, n - length + 1, (resamples, -(-n // length)))
    return (starts[..., None] + np.arange(length)).reshape(resamples, -1)[:, :n]


def independent(calls: dict[str, object], seconds: float, rng: np.random.Generator,
                block_ms: float = BLOCK_MS, statistic: str = "median") -> tuple[float, float, float]:
    """A plain timeit loop, not the stage's code: blocks of calls, the two engines' blocks alternating (ABBA, so
    neither always runs first), each block pair one ratio; the median of the pairs' ratios (first / second) with a
    percentile-bootstrap 95% interval over the pairs, resampled in runs of consecutive pairs (a moving-block
    bootstrap): the machine's state drifts over seconds, so neighbouring pairs are alike, and resampling pairs
    one by one would give an interval too narrow to hold the next few seconds' ratio.

    (It used to time each engine alone for half the time, engine after engine: on a shared machine the load
    changed between the halves, and the bootstrap of each half's blocks, blind to that, gave a far too narrow
    interval around a ratio biased by whatever ran meanwhile: 0.925x [0.903, 1.02] against the stage's 1.06x.)
    """
    names = list(calls)
    number = {}
    for name, call in calls.items():
        for _ in range(3):
            call()
        start = time.perf_counter()
        call()
        number[name] = max(1, int(block_ms / max((time.perf_counter() - start) * 1e3, 1e-3)))

    def block(name: str) -> float:
        """One block's value, after two untimed calls (the first calls after the other engine ran pay for caches it
        evicted, a cost an engine serving alone never pays): the mean call time (what throughput reads) or the
        median one (what the stage reads of a slot, robust to a descheduled call)."""
        call, count = calls[name], number[name]
        call()
        call()
        if statistic == "mean":
            start = time.perf_counter()
            for _ in range(count):
                call()
            return (time.perf_counter() - start) * 1e3 / count
        times = []
        for _ in range(count):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        return float(np.median(times)) * 1e3

    ratios, until = [], time.perf_counter() + seconds
    while time.perf_counter() < until or len(ratios) < 8:
        order = names if len(ratios) % 2 == 0 else names[::-1]
        got = {name: block(name) for name in order}
        ratios.append(got[names[0]] / got[names[1]])
    logs = np.log(np.array(ratios))
    boots = np.median(logs[moving_blocks(logs.size, rng)], axis=1)
    return (float(np.exp(np.median(logs))), float(np.exp(np.percentile(boots, 2.5))),
            float(np.exp(np.percentile(boots, 97.5))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=3.0, help="max_seconds of the stage's rounds and the "
                        "independent timer's time per pair")
    parser.add_argument("--precision", type=float, default=0.03)
    parser.add_argument("--min-rounds", type=int, default=10)
    parser.add_argument("--min-seconds", type=float, default=BenchmarkSpec().min_seconds,
                        help="the stage's rounds span at least this (benchmark.min_seconds)")
    parser.add_argument("--statistic", choices=("median", "mean"), default="median",
                        help="the independent timer's value per block: median call (the stage's estimand) or mean call")
    parser.add_argument("--block-ms", type=float, default=BLOCK_MS, help="the independent timer's block length")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        models = make_models(Path(tmp))
        pairs = {
            "fp32 vs int8 b8 s64": ((models["fp32"], True, 8, 64), (models["int8"], True, 8, 64)),
            "fp32 unoptimised vs optimised b4 s64": ((models["fp32"], False, 4, 64), (models["fp32"], True, 4, 64)),
            "int8 vs fp32 b1 s32": ((models["int8"], True, 1, 32), (models["fp32"], True, 1, 32)),
        }
        rng = np.random.default_rng(0)
        agree = {name: 0 for name in pairs}
        print(f"threads {args.threads}, budget {args.seconds:g}s per pair and method, precision ±{args.precision:.0%}, "
              f"independent blocks of {args.block_ms:g} ms, {args.statistic} call per block")
        for name, (first, second) in pairs.items():
            calls = {"a": session_call(first[0], args.threads, *first[1:]),
                     "b": session_call(second[0], args.threads, *second[1:])}
            for repeat in range(args.repeats):
                rounds = measure_rounds([Contender(k, call_timer(c)) for k, c in calls.items()], [("a", "b")],
                                        warmup=5, min_rounds=args.min_rounds, max_seconds=args.seconds, precision=args.precision,
                                        min_seconds=args.min_seconds)
                staged = rounds.ratio("a", "b")
                ratio, low, high = independent(calls, args.seconds, rng, args.block_ms, args.statistic)
                inside = staged.low <= ratio <= staged.high and low <= staged.ratio <= high
                agree[name] += inside
                print(f"{name:<38} #{repeat + 1}: stage {staged.text()} ({staged.rounds} rounds)  "
                      f"independent {ratio:.3g}x [{low:.3g}, {high:.3g}]  {'both inside' if inside else 'MISS'}")
        for name, hits in agree.items():
            print(f"{name:<38} each estimate inside the other's interval in {hits} of {args.repeats} repeats")


if __name__ == "__main__":
    main()
