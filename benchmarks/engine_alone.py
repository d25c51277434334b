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

One in-run measurement against passes taken minutes after it still compares two moments of the machine. With
`--runs K` the stage measures again K times (`smelter run` in its own process, as a user runs it: the
pipeline's benchmark outputs deleted, or with `--fresh` on new empty stores, so the run exports, calibrates and
builds in that process first), each run followed at once by one alone pass: both sides are then medians over
the same minutes, and `paired` is the median of each run against the pass right after it.

Tolerances (in-run vs alone): p50 within 10%, p99 within 25%, speedup within 10%.
Usage: python benchmarks/engine_alone.py [-f pipelines.yaml] [--pipeline NAME ...] [--passes 5 | --runs K [--fresh]]
       [--calls 200] [--min-seconds 5] [--all-points] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
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


def check_target(args: argparse.Namespace, pipeline: str, target: str, artifacts: Path) -> list[dict[str, Any]]:
    """The stage's figures against the engines alone: the newest measurement and `--passes` alone passes, or with
    `--runs`, that many measurements taken again, each followed at once by one alone pass (so the machine's drift
    over the minutes of the check meets both sides alike)."""
    measurements: list[dict[str, Any]] = []
    points: list[dict[str, int]] = []
    passes: list[list[dict[str, list[float]]]] = []
    rngs: list[random.Random] = []
    for index in range(args.runs or args.passes):
        stores = measure_again(args, pipeline, artifacts, index) if args.runs else artifacts
        # without --runs every pass is checked against the one measurement read first
        measurement = newest_measurement(stores, pipeline, target) if args.runs or not measurements \
            else measurements[0]
        if measurement is None:
            print(f"{pipeline}/{target}: no measurement in {stores}: run `smelter run` first")
            return []
        if not points:
            engine = next(iter(measurement["outputs"]["engines"].values()))
            rows = engine["points"] + engine.get("decode", []) if args.all_points else [engine["gate_point"]]
            points = [gate_shape(row) for row in rows]
            passes, rngs = [[] for _ in points], [random.Random(0) for _ in points]
        measurements.append(measurement)
        for point, done, rng in zip(points, passes, rngs):
            done.append(alone_pass(args, pipeline, measurement, stores, point, rng))
    return [report(args, pipeline, target, point, measurements, done) for point, done in zip(points, passes)]


def measure_again(args: argparse.Namespace, pipeline: str, artifacts: Path, index: int) -> Path:
    """One `smelter run` of the pipeline that measures again, in its own process as a user's run: with `--fresh`
    on new empty stores (it exports, calibrates and builds in that process first), else on the given stores with
    the pipeline's benchmark outputs deleted (every other stage cached). Returns the artifact store it wrote."""
    env = dict(os.environ)
    if args.fresh:
        root = Path(tempfile.mkdtemp(prefix=f"engine-alone-{pipeline}-"))
        env["MLFLOW_TRACKING_URI"] = f"sqlite:///{root / 'mlflow.db'}"
        artifacts = root / "artifacts"
    else:
        shutil.rmtree(artifacts / pipeline / "benchmark", ignore_errors=True)
    began = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "flows.cli", "run", "-q", "-f", args.file, "--pipeline", pipeline,
                          "--artifacts", str(artifacts)], env=env, capture_output=True, text=True)
    print(f"{pipeline}: run {index + 1} of {args.runs} ({'fresh stores' if args.fresh else 'benchmark again'}) "
          f"exit {run.returncode} in {time.monotonic() - began:.0f} s", flush=True)
    if run.returncode not in (0, 1):
        raise RuntimeError(f"{pipeline}: `smelter run` failed:\n{run.stderr[-3000:]}")
    return artifacts


def alone_pass(args: argparse.Namespace, pipeline: str, measurement: dict[str, Any], artifacts: Path,
               point: dict[str, int], rng: random.Random) -> dict[str, list[float]]:
    """Every contender of `measurement` timed alone once, each in a fresh process, in an order drawn from `rng`."""
    outputs, builds = measurement["outputs"], measurement["inputs"]["builds"]
    candidates = list(outputs["engines"])
    engine_dirs = {name: str(artifacts / pipeline / "build" / builds[name]) for name in candidates}
    order = [REFERENCE] + candidates
    rng.shuffle(order)
    samples = {}
    for name in order:
        job = {"file": args.file, "pipeline": pipeline, "contender": name, "point": point,
               "engine_dir": engine_dirs.get(name, engine_dirs[candidates[0]]), "threads": outputs["threads"],
               "warmup": args.warmup, "calls": args.calls, "min_seconds": args.min_seconds}
        samples[name] = alone(job)
    return samples


def _spread(values: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(values), "spread": [min(values), max(values)], "each": values}


def report(args: argparse.Namespace, pipeline: str, target: str, point: dict[str, int],
           measurements: list[dict[str, Any]], passes: list[dict[str, list[float]]]) -> dict[str, Any]:
    """Each contender's in-run figures (median over the measurements) against its alone ones (median over the
    passes), each with its min-max spread; `paired` is the median over runs of in-run / the alone pass right after
    it (the machine's drift over minutes cancels out when each run has its own pass). A measurement the stage found
    contended decides nothing there, so with `--runs` it is left out here too, with its pass, and said."""
    busy = [index for index, m in enumerate(measurements) if m["outputs"]["host"].get("contended")]
    left_out = busy if args.runs and len(busy) < len(measurements) else []
    if left_out:
        for index in left_out:
            print(f"\n{pipeline}/{target}: run {index + 1} left out: the stage found it contended (other processes "
                  f"used {measurements[index]['outputs']['host']['foreign_cpu_share']:.0%} of the CPU)")
        measurements = [m for index, m in enumerate(measurements) if index not in busy]
        passes = [p for index, p in enumerate(passes) if index not in busy]
    candidates = list(measurements[0]["outputs"]["engines"])
    recorded: dict[str, dict[str, list[float]]] = {name: {"p50_ms": [], "p99_ms": [], "speedup": []}
                                                    for name in [REFERENCE, *candidates]}
    for measurement in measurements:
        rows = {name: rows_at(measurement["outputs"]["engines"][name], point) for name in candidates}
        reference = rows[candidates[0]]
        recorded[REFERENCE]["p50_ms"].append(reference["reference_p50_ms"])
        recorded[REFERENCE]["p99_ms"].append(reference["reference_p99_ms"])
        for name in candidates:
            for key in ("p50_ms", "p99_ms"):
                recorded[name][key].append(rows[name][key])
            recorded[name]["speedup"].append(rows[name]["speedup_vs_reference"])
    measured: dict[str, dict[str, list[float]]] = {name: {"p50_ms": [], "p99_ms": [], "speedup": []}
                                                    for name in recorded}
    for samples in passes:
        for name in recorded:
            measured[name]["p50_ms"].append(float(np.percentile(samples[name], 50)))
            measured[name]["p99_ms"].append(float(np.percentile(samples[name], 99)))
        for name in candidates:  # the reference and the engine timed in the same pass, seconds apart
            measured[name]["speedup"].append(statistics.median(samples[REFERENCE]) / statistics.median(samples[name]))
    distinct = list({m["_dir"]: m for m in measurements}.values())  # without --runs, one measurement each pass
    shares = [m["outputs"]["host"].get("foreign_cpu_share") for m in distinct]
    champion = measurements[0]["outputs"].get("champion") or {}
    extra = " and the champion" if champion.get("label") and champion["label"] not in candidates else ""
    print(f"\n{pipeline}/{target} at {point}, {len(candidates)} candidate(s){extra}; {len(distinct)} in-run "
          f"measurement(s), {len(passes)} alone pass(es) of at least {args.calls} calls over {args.min_seconds:g} s; "
          f"other processes' CPU share while measured: {shares}")
    print(f"{'contender':<22} {'figure':<8} {'in-run [spread]':>26} {'alone [spread]':>26} {'in/alone':>12} "
          f"{'paired':>8}")
    rows = []
    for name in recorded:
        row: dict[str, Any] = {"contender": name}
        for key in ("p50_ms", "p99_ms", "speedup"):
            if name == REFERENCE and key == "speedup":
                continue
            mine, alone_ = _spread(recorded[name][key]), _spread(measured[name][key])
            pairs = [a / b for a, b in zip(recorded[name][key], measured[name][key])]
            off = mine["median"] / alone_["median"] - 1
            paired = statistics.median(pairs) - 1
            verdict = "ok" if abs(off) <= TOLERANCE[key] else "OFF"
            row[key] = {"in_run": mine, "alone": alone_, "off": off, "paired_off": paired, "within": verdict == "ok"}
            print(f"{name:<22} {key:<8} {mine['median']:>9.3f} [{mine['spread'][0]:.3f}, {mine['spread'][1]:.3f}]"
                  f" {alone_['median']:>9.3f} [{alone_['spread'][0]:.3f}, {alone_['spread'][1]:.3f}] "
                  f"{off:>+7.1%} {verdict:<3} {paired:>+7.1%}")
        rows.append(row)
    return {"pipeline": pipeline, "target": target, "point": point,
            "measurements": [m["_dir"] for m in distinct], "hosts": [m["outputs"]["host"] for m in distinct],
            "threads": measurements[0]["outputs"]["threads"], "champion_timed": bool(extra), "runs": args.runs,
            "left_out_contended": [index + 1 for index in left_out], "fresh": args.fresh,
            "passes": len(passes), "calls": args.calls, "min_seconds": args.min_seconds, "rows": rows}


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
    parser.add_argument("--runs", type=int, default=0,
                        help="measure again this many times with `smelter run` (the pipeline's benchmark outputs "
                             "deleted first), each run followed at once by one alone pass; instead of --passes")
    parser.add_argument("--fresh", action="store_true",
                        help="with --runs: each run on new empty stores, so it exports and builds first")
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
            results += check_target(args, name, target.name, artifacts)
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": isa, "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
