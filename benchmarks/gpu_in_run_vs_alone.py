"""An inductor engine on the GPU: the latency smelter's benchmark stage records for it against the same engine alone.

In-run: the engine and the PyTorch fp32 reference timed by the stage's own rounds (tasks.measure.rounds:
interleaved slots, ABBA orders, a pause before each slot, CUDA events for both, as the stage times
GPU contenders). Alone: the same engine, then the same reference, each loaded in a fresh process
that times only it (10 untimed calls, then `--calls` timed with CUDA events), in `--passes`
alternating passes so that the machine's drift shows as their spread. Reported: medians (p10-p90)
of every call in the run, the median and range of the alone passes' medians, each in-run median
over its alone median, and the speedup vs the reference both ways.

The engine is MiniLM-shaped (all-MiniLM-L6-v2's sizes, random weights), bf16, built here for one
shape, which is the point timed.

Usage: python -m benchmarks.gpu_in_run_vs_alone --out in_run_vs_alone.json [--batch 32 --seq 128] [--passes 3]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tasks.measure import gpu_measure as gm

REFERENCE = "pytorch"


def feeds(batch: int, seq: int) -> dict[str, np.ndarray]:
    ids = np.random.default_rng(5).integers(0, 30522, (batch, seq), dtype=np.int64)
    return {"input_ids": ids, "attention_mask": np.ones_like(ids)}


def reference_timer(model_dir: Path, inputs: dict[str, np.ndarray]) -> Any:
    """The fp32 reference called as the stage calls it on a GPU (inputs on the device, a synchronize after
    each call) and timed as the stage times it (CUDA events)."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    tensors = {name: torch.from_numpy(value).cuda() for name, value in inputs.items()}

    @torch.inference_mode()
    def call() -> Any:
        out = model(**tensors)
        torch.cuda.synchronize()
        return out

    return lambda n: gm.cuda_times_ms(call, 0, n)


def engine_timer(engine_dir: Path, inputs: dict[str, np.ndarray]) -> Any:
    from tasks.backends.inductor.backend import InductorBackend
    from tasks.config.spec import InductorTarget

    target = InductorTarget(**json.loads((engine_dir / "target.json").read_text()))
    runner = InductorBackend().load(engine_dir, target)
    return lambda n: runner.time_ms(inputs, 0, n)


def alone(who: str, engine_dir: Path, model_dir: Path, batch: int, seq: int, calls: int) -> None:
    """In a fresh process: time `who` alone and print its summary as JSON."""
    inputs = feeds(batch, seq)
    timer = engine_timer(engine_dir, inputs) if who == "engine" else reference_timer(model_dir, inputs)
    timer(10)
    print(json.dumps(gm.summary(timer(calls))))


def build(work: Path, batch: int, seq: int) -> tuple[Path, Path, dict[str, Any]]:
    from benchmarks.gpu_pipeline import MINILM, make_model
    from tasks.backends.inductor.backend import InductorBackend
    from tasks.runtime.gpu import detect_gpu
    from tasks.config.spec import InductorTarget, ProfileSpec

    model_dir, engine_dir = work / "minilm", work / "engine"
    make_model("encoder", MINILM, model_dir)
    engine_dir.mkdir()
    target = {"name": "sm90", "backend": "inductor", "device": "cuda", "arch": detect_gpu().arch}
    facts = InductorBackend().build_from_model(model_dir, "feature-extraction", "bf16", InductorTarget(**target),
                                               [ProfileSpec(batch=[1, batch, batch], seq=[1, seq, seq])], engine_dir)
    (engine_dir / "target.json").write_text(json.dumps(target))
    return engine_dir, model_dir, facts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--alone", choices=["engine", REFERENCE], help=argparse.SUPPRESS)
    parser.add_argument("--engine", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.alone:
        alone(args.alone, args.engine, args.model, args.batch, args.seq, args.calls)
        return
    from tasks.measure.rounds import Contender, measure_rounds
    from tasks.config.spec import BenchmarkSpec

    settings = BenchmarkSpec()  # the stage's defaults: warmup, min_rounds, max_seconds, precision
    result: dict[str, Any] = {"command": "python -m benchmarks.gpu_in_run_vs_alone " + " ".join(sys.argv[1:]),
                              "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                              "gpu": torch.cuda.get_device_name(), "point": [args.batch, args.seq],
                              "stage_settings": {k: getattr(settings, k) for k in (
                                  "warmup", "min_rounds", "max_seconds", "precision")}}
    with tempfile.TemporaryDirectory(prefix="in-run-") as tmp:
        engine_dir, model_dir, facts = build(Path(tmp), args.batch, args.seq)
        result["engine_build"] = {k: facts.get(k) for k in ("compile_seconds", "format")}
        inputs = feeds(args.batch, args.seq)
        timers = {REFERENCE: reference_timer(model_dir, inputs), "engine": engine_timer(engine_dir, inputs)}
        started = time.perf_counter()
        rounds = measure_rounds([Contender(name, timer) for name, timer in timers.items()], [(REFERENCE, "engine")],
                                warmup=settings.warmup, min_rounds=settings.min_rounds,
                                max_seconds=settings.max_seconds, precision=settings.precision)
        ratio = rounds.ratio(REFERENCE, "engine")
        result["in_run"] = {name: gm.summary(rounds.calls_ms(name)) for name in timers}
        result["in_run"]["speedup"] = {"ratio": round(ratio.ratio, 4), "ci": [round(ratio.low, 4), round(ratio.high, 4)],
                                       "rounds": rounds.count, "seconds": round(time.perf_counter() - started, 1)}
        del timers
        torch.cuda.empty_cache()
        passes: dict[str, list[dict[str, float]]] = {"engine": [], REFERENCE: []}
        for _ in range(args.passes):
            for who in passes:
                out = subprocess.run([sys.executable, "-m", "benchmarks.gpu_in_run_vs_alone", "--alone", who,
                                      "--engine", str(engine_dir), "--model", str(model_dir), "--batch", str(args.batch),
                                      "--seq", str(args.seq), "--calls", str(args.calls)],
                                     capture_output=True, text=True, timeout=300)
                if out.returncode:
                    raise RuntimeError(f"alone {who} failed: {out.stderr[-2000:]}")
                passes[who].append(json.loads(out.stdout.strip().splitlines()[-1]))
    medians = {who: [p["median_ms"] for p in runs] for who, runs in passes.items()}
    result["alone"] = {who: {"median_ms": round(statistics.median(m), 4), "pass_medians_ms": m,
                             "pass_p10_p90_ms": [[p["p10_ms"], p["p90_ms"]] for p in passes[who]]}
                       for who, m in medians.items()}
    result["alone"]["speedup"] = round(result["alone"][REFERENCE]["median_ms"] / result["alone"]["engine"]["median_ms"], 4)
    result["in_run_over_alone"] = {who: round(result["in_run"][who]["median_ms"] / result["alone"][who]["median_ms"], 4)
                                   for who in passes}
    result["in_run_over_alone"]["speedup"] = round(result["in_run"]["speedup"]["ratio"] / result["alone"]["speedup"], 4)
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
