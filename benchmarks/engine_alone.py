"""What a benchmark stage recorded, checked against each engine timed alone in a fresh process.

For each pipeline's ONNX Runtime (CPU) target, the newest measurement in the artifact store (what the last
`smelter run` recorded, and so what gates, decisions and the registry read): every candidate's p50 and p99 at
the gate point and its speedup over the PyTorch reference. Then each contender runs alone, outside the stage's
code path: a fresh Python process loads one engine (ONNX Runtime directly, with the session settings its build
recorded in engine.json) or the reference, makes the same feeds, runs `--warmup` untimed calls, then timed
ones with its own perf_counter loop (at least `--calls` of them over at least `--min-seconds`: the run's
rounds span seconds, so its p99 meets the machine's periodic work, and 200 calls of a 0.3 ms engine span
60 ms, which meet none), and prints the samples. Nothing else of smelter runs meanwhile.

Two alone measurements of one engine minutes apart can differ by tens of percent on a shared machine, so the
processes are alternated over `--passes` passes (another order each pass) and the median over passes is kept,
with the passes' min-max spread beside it: a spread wider than a tolerance is said, never hidden.

Tolerances (in-run vs alone): p50 within 10%, p99 within 25%, speedup within 10%.
Usage: python benchmarks/engine_alone.py [-f pipelines.yaml] [--pipeline NAME ...] [--passes 5] [--calls 200]
       [--min-seconds 5] [--all-points] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

TOLERANCE = {"p50_ms": 0.10, "p99_ms": 0.25, "speedup": 0.10}
REFERENCE = "pytorch-fp32"


def newest_measurement(artifacts: Path, pipeline: str, target: str) -> dict[str, Any] | None:
    """The manifest of the newest published benchmark of (pipeline, target): its candidates are named
    <pipeline>/<precision>/<target>."""
    found = []
    for manifest in (artifacts / pipeline / "benchmark").glob("*/manifest.json"):
        data = json.loads(manifest.read_text())
        if all(name.endswith(f"/{target}") for name in data["inputs"]["builds"]):
            found.append((data["created_unix"], data, manifest.parent))
    if not found:
        return None
    _, data, where = max(found, key=lambda item: item[0])
    return data | {"_dir": str(where)}


def gate_shape(row: dict[str, Any]) -> dict[str, int]:
    """The gate point as the engine is fed: a decode step has `past`, a prefill `seq`."""
    return {"batch": row["batch"], "seq": 1, "past": row["past"], "decode": 1} if "past" in row else \
        {"batch": row["batch"], "seq": row["seq"], "decode": 0}


def run_one(job: dict[str, Any]) -> dict[str, Any]:
    """In the child: load one contender, feed it the gate point, time it alone."""
    import onnxruntime as ort
    import torch

    from tasks.stages.benchmark import fed_shape, prefill_past, reference_call
    from tasks.stages.inputs import point_feeds, read_texts
    from tasks.config.stage_settings import ModelSource
    from tasks.stages.models import load_reference, load_tokenizer
    from tasks.config.spec import load

    spec = load(job["file"], check_env=False).pipelines[job["pipeline"]]
    source = ModelSource.of(spec)
    point = job["point"]
    past = point["past"] if point["decode"] else prefill_past(spec.model, spec.profiles)
    shape = fed_shape(spec.model, point["batch"], point["seq"], past)
    engine_dir = Path(job["engine_dir"])
    recorded = json.loads((engine_dir / "engine.json").read_text())["session_options"]
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # optimized at build
    options.intra_op_num_threads = job["threads"]
    for key, value in recorded.get("config_entries", {}).items():
        options.add_session_config_entry(key, value)
    session = ort.InferenceSession(str(engine_dir / "model.onnx"), options, providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    reference = load_reference(source)
    feeds = point_feeds(spec.model, load_tokenizer(source), reference, read_texts(spec.resolve(spec.accuracy.data)),
                        shape, names)
    if job["contender"] == REFERENCE:
        del session
        torch.set_num_threads(job["threads"])
        call = reference_call(reference, feeds, spec.model.task)
    else:
        def call() -> Any:
            return session.run(None, feeds)
    for _ in range(job["warmup"]):
        call()
    samples = []
    began = time.perf_counter()
    while len(samples) < job["calls"] or time.perf_counter() - began < job["min_seconds"]:
        start = time.perf_counter()
        call()
        samples.append((time.perf_counter() - start) * 1e3)
    return {"samples_ms": samples}


def alone(job: dict[str, Any]) -> list[float]:
    child = subprocess.run([sys.executable, __file__, "--one", json.dumps(job)], capture_output=True, text=True)
    if child.returncode != 0:
        raise RuntimeError(f"{job['contender']}: the alone process failed:\n{child.stderr[-2000:]}")
    return json.loads(child.stdout.strip().splitlines()[-1])["samples_ms"]


def within(recorded: float, measured: float, tolerance: float) -> str:
    off = recorded / measured - 1
    return f"{off:+.1%} {'ok' if abs(off) <= tolerance else 'OFF'}"


def rows_at(engine: dict[str, Any], point: dict[str, int]) -> dict[str, Any]:
    """The recorded row of one engine at `point`."""
    key = "decode" if point["decode"] else "points"
    return next(row for row in engine.get(key, []) if gate_shape(row) == point)


def check_target(args: argparse.Namespace, pipeline: str, target: str, measurement: dict[str, Any],
                 artifacts: Path) -> list[dict[str, Any]]:
    outputs = measurement["outputs"]
    engines = outputs["engines"]
    candidates = list(engines)
    first = engines[candidates[0]]
    points = [gate_shape(first["gate_point"])]
    if args.all_points:
        points = [gate_shape(row) for row in first["points"] + first.get("decode", [])]
    return [check_point(args, pipeline, target, measurement, artifacts, point) for point in points]


def check_point(args: argparse.Namespace, pipeline: str, target: str, measurement: dict[str, Any],
                artifacts: Path, point: dict[str, int]) -> dict[str, Any]:
    outputs = measurement["outputs"]
    builds = measurement["inputs"]["builds"]
    candidates = list(outputs["engines"])
    recorded_rows = {name: rows_at(outputs["engines"][name], point) for name in candidates}
    engine_dirs = {name: str(artifacts / pipeline / "build" / builds[name]) for name in candidates}
    contenders = [REFERENCE] + candidates
    samples: dict[str, list[list[float]]] = {name: [] for name in contenders}
    order = list(contenders)
    rng = random.Random(0)
    for _ in range(args.passes):
        rng.shuffle(order)
        for name in order:
            job = {"file": args.file, "pipeline": pipeline, "contender": name, "point": point,
                   "engine_dir": engine_dirs.get(name, engine_dirs[candidates[0]]), "threads": outputs["threads"],
                   "warmup": args.warmup, "calls": args.calls, "min_seconds": args.min_seconds}
            samples[name].append(alone(job))
    figures: dict[str, Any] = {}
    for name in contenders:
        p50s = [float(np.percentile(s, 50)) for s in samples[name]]
        p99s = [float(np.percentile(s, 99)) for s in samples[name]]
        figures[name] = {"p50_ms": statistics.median(p50s), "p50_spread": [min(p50s), max(p50s)],
                         "p99_ms": statistics.median(p99s), "p99_spread": [min(p99s), max(p99s)]}
    for name in candidates:  # each pass's ratio of medians, the reference and the engine timed minutes apart
        ratios = [statistics.median(r) / statistics.median(e) for r, e in zip(samples[REFERENCE], samples[name])]
        figures[name] |= {"speedup": statistics.median(ratios), "speedup_spread": [min(ratios), max(ratios)]}
    rows = []
    reference_row = recorded_rows[candidates[0]]
    print(f"\n{pipeline}/{target} at {point}, {len(candidates)} candidate(s), {args.passes} passes of at least "
          f"{args.calls} calls over {args.min_seconds:g} s; measurement {measurement['_dir']} (other processes used "
          f"{outputs['host'].get('foreign_cpu_share')} of the CPU while it was taken)")
    print(f"{'contender':<24} {'in-run p50':>10} {'alone p50 [spread]':>26} {'':>10} {'in-run p99':>10} "
          f"{'alone p99 [spread]':>26} {'':>10} {'in-run x':>8} {'alone x [spread]':>22}")
    for name in contenders:
        mine = figures[name]
        recorded = ({"p50_ms": reference_row["reference_p50_ms"], "p99_ms": reference_row["reference_p99_ms"]}
                    if name == REFERENCE else recorded_rows[name])
        row = {"contender": name, "in_run_p50_ms": recorded["p50_ms"], "in_run_p99_ms": recorded["p99_ms"]} | mine
        line = (f"{name:<24} {recorded['p50_ms']:>10.2f} {mine['p50_ms']:>9.2f} [{mine['p50_spread'][0]:.2f}, "
                f"{mine['p50_spread'][1]:.2f}] {within(recorded['p50_ms'], mine['p50_ms'], TOLERANCE['p50_ms']):>10} "
                f"{recorded['p99_ms']:>10.2f} {mine['p99_ms']:>9.2f} [{mine['p99_spread'][0]:.2f}, "
                f"{mine['p99_spread'][1]:.2f}] {within(recorded['p99_ms'], mine['p99_ms'], TOLERANCE['p99_ms']):>10}")
        if name != REFERENCE:
            row["in_run_speedup"] = recorded["speedup_vs_reference"]
            line += (f" {recorded['speedup_vs_reference']:>8.3f} {mine['speedup']:>7.3f} "
                     f"[{mine['speedup_spread'][0]:.3f}, {mine['speedup_spread'][1]:.3f}] "
                     f"{within(recorded['speedup_vs_reference'], mine['speedup'], TOLERANCE['speedup'])}")
        print(line)
        rows.append(row)
    return {"pipeline": pipeline, "target": target, "point": point, "measurement": measurement["_dir"],
            "host": outputs["host"], "threads": outputs["threads"], "passes": args.passes, "calls": args.calls,
            "min_seconds": args.min_seconds,
            "rows": rows}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-f", "--file", default="pipelines.yaml")
    parser.add_argument("--artifacts", help="artifact store (default: artifacts/ beside the pipelines file)")
    parser.add_argument("--pipeline", action="append", default=[])
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--min-seconds", type=float, default=5.0,
                        help="time calls for at least this long (a p99 of 60 ms of calls meets none of the "
                             "machine's periodic work that the run's seconds of rounds meet)")
    parser.add_argument("--all-points", action="store_true", help="every point the stage measured, not only the gate point")
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(json.loads(args.one))))
        return 0
    from tasks.backends.onnxruntime.backend import cpu_isa
    from tasks.config.spec import load

    specs = load(args.file, check_env=False).pipelines
    artifacts = Path(args.artifacts) if args.artifacts else Path(args.file).resolve().parent / "artifacts"
    isa = cpu_isa()
    print(f"cpu: {isa['cpu']}; flags: {' '.join(isa['isa'])}")
    results = []
    for name in args.pipeline or list(specs):
        for target in specs[name].targets:
            if target.backend != "onnxruntime":
                print(f"{name}/{target.name}: {target.backend} engines are checked on their own device "
                      "(benchmarks/gpu_pipeline.py), skipped here")
                continue
            measurement = newest_measurement(artifacts, name, target.name)
            if measurement is None:
                print(f"{name}/{target.name}: no measurement in {artifacts}: run `smelter run` first")
                continue
            results += check_target(args, name, target.name, measurement, artifacts)
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": isa, "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
