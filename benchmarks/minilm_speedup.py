"""The promoted minilm engine vs PyTorch eager FP32 at batch 8 x seq 128, measured side by side in one run.

Reads the current champion from the MLflow registry (run `smelter run --pipeline minilm` first),
re-measures its engine with the benchmark stage's own paired rounds (to a tighter precision than a
nightly run) and prints throughput, the ratio with its 95% interval and the champion's accuracy.
Usage: python benchmarks/minilm_speedup.py [-f pipelines.yaml] [--target cpu] [--precision 0.02]
"""

from __future__ import annotations

import argparse
import sys
import tempfile

from tasks.backends.onnxruntime.backend import cpu_isa
from tasks.config.settings import RegistrySettings
from tasks.config.spec import load
from tasks.config.stage_settings import BenchmarkConfig
from tasks.registry import tracking
from tasks.runtime.store import ArtifactStore
from tasks.stages.benchmark import run_benchmark

GOAL_SPEEDUP, GOAL_COSINE_MEAN, GOAL_COSINE_MIN = 2.0, 0.99, 0.97


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-f", "--file", default="pipelines.yaml")
    parser.add_argument("--pipeline", default="minilm")
    parser.add_argument("--target", default="cpu")
    parser.add_argument("--artifacts", default="artifacts")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--precision", type=float, default=0.02, help="stop at this interval half-width")
    parser.add_argument("--max-seconds", type=float, default=120)
    args = parser.parse_args()

    spec = load(args.file, check_env=False).pipelines[args.pipeline]
    champion = tracking.champion(RegistrySettings.of(spec), args.target)
    if champion is None:
        print(f"no champion for {args.pipeline}/{args.target} yet: run `smelter run --pipeline {args.pipeline}` first",
              file=sys.stderr)
        return 2
    build = ArtifactStore(args.artifacts).lookup(spec.name, "build", champion.build_key or "")
    if build is None:
        print(f"engine {champion.build_key} of the champion is not in {args.artifacts}/", file=sys.stderr)
        return 2
    spec = spec.model_copy(update={
        "benchmark": spec.benchmark.model_copy(update={"batch_sizes": [args.batch], "seq_lens": [args.seq],
                                                       "precision": args.precision, "max_seconds": args.max_seconds,
                                                       "warmup": 10}),
        "performance": spec.performance.model_copy(update={"at": {"batch": args.batch, "seq": args.seq}})})
    name = f"{spec.name}/{champion.precision}/{args.target}"
    with tempfile.TemporaryDirectory() as scratch:
        result = run_benchmark(BenchmarkConfig.of(spec, args.target), {name: build}, ArtifactStore(scratch), force=True)
    point = result.outputs["engines"][name]["gate_point"]
    metrics = tracking.run_metrics(champion.run_id)
    cosine_mean, cosine_min = metrics.get("accuracy.cosine_mean", float("nan")), metrics.get("accuracy.cosine_min", float("nan"))
    low, high = point["speedup_vs_reference_ci"]
    print(f"champion      {name} (v{champion.version}, engine {champion.build_key})")
    print(f"shape         batch {args.batch} x seq {args.seq}, {point['rounds']} interleaved rounds in {point['seconds']:.0f} s")
    print(f"engine        {point['throughput']:8.1f} samples/s   p50 {point['p50_ms']:7.1f} ms   p99 {point['p99_ms']:7.1f} ms")
    print(f"pytorch fp32  {point['reference_throughput']:8.1f} samples/s   p50 {point['reference_p50_ms']:7.1f} ms"
          f"   p99 {point['reference_p99_ms']:7.1f} ms")
    print(f"speedup       {point['speedup_vs_reference']:.2f}x [{low:.2f}, {high:.2f}] (95%)   goal >= {GOAL_SPEEDUP}x")
    print(f"accuracy      cosine mean {cosine_mean:.4f} (goal >= {GOAL_COSINE_MEAN}), "
          f"min {cosine_min:.4f} (goal >= {GOAL_COSINE_MIN})")
    isa = cpu_isa()
    print(f"cpu           {isa['cpu']}: {' '.join(isa['isa'])} (int8 is fast with avx512_vnni/avx_vnni/amx_int8)")
    print(f"host          other processes used {result.outputs['host']['foreign_cpu_share']:.0%} of the CPU")
    return 0


if __name__ == "__main__":
    sys.exit(main())
