"""Latency and throughput of an engine next to the PyTorch eager FP32 reference, in one run.

The reference is measured in the same process, on the same feeds and thread count, in blocks
that alternate with the engine's, so a noisy neighbour slows both alike and the speedup is a
ratio of two numbers taken side by side. Raw samples are kept; percentiles are derived from them.
"""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from tasks.backends.base import Runner
from tasks.build import open_engine
from tasks.inputs import PAST_PREFIX, past_cache, past_layers, point_feeds, read_texts
from tasks.models import load_reference, load_tokenizer
from tasks.spec import PipelineSpec
from tasks.store import ArtifactStore, StageResult, file_digest, host_facts, stage_key, tool_versions

if TYPE_CHECKING:
    import torch

SAMPLES = "samples.csv"
PLOT = "latency.png"
REFERENCE = "pytorch-fp32"
BLOCKS = 5
SPEEDUP_BASIS = "p50"
TOOLS = ("torch", "transformers", "numpy")


@dataclass
class LatencySamples:
    """Raw per-call latencies of one engine at one shape; every statistic is derived from them."""

    samples_ms: list[float] = field(default_factory=list)

    def add(self, samples_ms: list[float]) -> None:
        self.samples_ms.extend(samples_ms)

    def percentile(self, q: float) -> float:
        return float(np.percentile(self.samples_ms, q))

    @property
    def mean_ms(self) -> float:
        return float(np.mean(self.samples_ms))

    def summary(self, batch: int, tokens_per_call: int) -> dict[str, float]:
        """Percentiles, mean, samples/s (batch / mean seconds) and tokens/s."""
        mean_s = self.mean_ms / 1e3
        return {"p50_ms": self.percentile(50), "p90_ms": self.percentile(90), "p99_ms": self.percentile(99),
                "mean_ms": self.mean_ms, "throughput": batch / mean_s, "tokens_per_s": tokens_per_call / mean_s}


@dataclass
class Measurement:
    """One shape point measured for both the engine and the reference."""

    batch: int
    seq: int
    past: int
    engine: LatencySamples
    reference: LatencySamples

    def row(self, tokens_per_call: int) -> dict[str, Any]:
        engine = self.engine.summary(self.batch, tokens_per_call)
        reference = self.reference.summary(self.batch, tokens_per_call)
        return {"batch": self.batch, "seq": self.seq, **engine,
                **{f"reference_{name}": value for name, value in reference.items()},
                "speedup_vs_reference": reference[f"{SPEEDUP_BASIS}_ms"] / engine[f"{SPEEDUP_BASIS}_ms"]}


def benchmark_threads(spec: PipelineSpec, target_threads: int | None) -> int:
    """One thread count for engine and reference: benchmark.threads, else the target's, else all cores."""
    return spec.benchmark.threads or target_threads or os.cpu_count() or 1


def benchmark_key(build_result: StageResult, spec: PipelineSpec) -> str:
    """Hash of the engine, the benchmark settings and the host (timings belong to the machine)."""
    return stage_key("benchmark", upstream={"build": build_result.key}, config=_benchmark_config(spec, build_result),
                     data=file_digest(spec.resolve(spec.accuracy.data)), host=host_facts(),
                     tools=tool_versions(*TOOLS))


def _benchmark_config(spec: PipelineSpec, build_result: StageResult) -> dict[str, Any]:
    target = spec.target(build_result.outputs["target"])
    return {"task": spec.model.task, "benchmark": spec.benchmark.model_dump(mode="json"),
            "gate_point": spec.gate_point, "threads": benchmark_threads(spec, target.threads),
            "speedup_basis": SPEEDUP_BASIS}


def run_benchmark(spec: PipelineSpec, build_result: StageResult, store: ArtifactStore,
                  force: bool = False) -> StageResult:
    """Every (batch, seq) of spec.benchmark (and decoders' decode step) for the engine and the reference."""
    key = benchmark_key(build_result, spec)
    if not force and (hit := store.lookup(spec.name, "benchmark", key)):
        return hit
    import torch

    config = _benchmark_config(spec, build_result)
    engine_label = build_result.outputs["backend"]
    texts = read_texts(spec.resolve(spec.accuracy.data))
    tokenizer = load_tokenizer(spec)
    reference = load_reference(spec)
    device = reference_device(build_result)
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(config["threads"])
    try:
        with open_engine(spec, build_result, threads=config["threads"]) as runner, \
                store.writing(spec.name, "benchmark", key, inputs={"build": build_result.key}, config=config,
                              tools=tool_versions(*TOOLS)) as w:
            bench = _Bench(spec, runner, reference, tokenizer, texts, device)
            prefill = [bench.measure(b, s, _prefill_past(spec)) for b in spec.benchmark.batch_sizes
                       for s in spec.benchmark.seq_lens]
            decode = ([bench.measure(b, 1, spec.benchmark.past_len) for b in spec.benchmark.batch_sizes]
                      if spec.model.is_decoder else [])
            points = [m.row(m.batch * m.seq) for m in prefill]
            w.outputs.update({
                "points": points,
                "gate_point": next(p for p in points if p["batch"] == spec.gate_point["batch"] and p["seq"] == spec.gate_point["seq"]),
                "threads": config["threads"], "speedup_basis": SPEEDUP_BASIS,
                "engine": engine_label, "reference": REFERENCE, "reference_device": device})
            if spec.model.is_decoder:
                w.outputs["decode"] = [_decode_row(m) for m in decode]
            _samples_table(prefill + decode, engine_label).to_csv(w.dir / SAMPLES, index=False)
            _plot(prefill + decode, engine_label, w.dir / PLOT)
    finally:
        torch.set_num_threads(previous_threads)
    return w.result


def reference_device(build_result: StageResult) -> str:
    """Where eager PyTorch runs: on the GPU beside a GPU engine when it can, so the speedup compares like with like."""
    import torch

    return "cuda" if build_result.outputs.get("backend") == "tensorrt" and torch.cuda.is_available() else "cpu"


def _prefill_past(spec: PipelineSpec) -> int:
    """Prefill runs on an empty cache, or on the shortest past the engine's profiles accept (a KV graph needs one)."""
    return min(p.past[0] for p in spec.profiles) if spec.model.has_past else 0


def _decode_row(m: Measurement) -> dict[str, Any]:
    """One generated token per sequence per step: tokens/s = batch / mean step seconds."""
    row = m.row(m.batch)
    del row["seq"]
    return {"batch": m.batch, "past": m.past, **row}


class _Bench:
    """Feeds and timed calls for one engine and the reference; alternates blocks of repeats between them."""

    def __init__(self, spec: PipelineSpec, runner: Runner, reference: torch.nn.Module, tokenizer: Any,
                 texts: list[str], device: str):
        self.spec, self.runner, self.reference, self.tokenizer, self.texts = spec, runner, reference, tokenizer, texts
        self.device = device
        self.timed_reference = reference if device == "cpu" else copy.deepcopy(reference).to(device)

    def feeds(self, batch: int, seq: int, past: int) -> dict[str, np.ndarray]:
        if past and not self.spec.model.has_past:
            # Without a KV cache a decode step re-reads the whole prefix: past + 1 tokens, no cache.
            seq, past = past + 1, 0
        return point_feeds(self.spec, self.tokenizer, self.reference, self.texts,
                           {"batch": batch, "seq": seq, "past": past}, self.runner.input_names)

    def measure(self, batch: int, seq: int, past: int) -> Measurement:
        feeds = self.feeds(batch, seq, past)
        forward = reference_call(self.timed_reference, feeds, self.spec.model.task, self.device)
        warmup, repeats = self.spec.benchmark.warmup, self.spec.benchmark.repeats
        engine, reference = LatencySamples(), LatencySamples()
        self.runner.time_ms(feeds, warmup, 0)
        time_call_ms(forward, warmup, 0)
        for block in _blocks(repeats):
            engine.add(self.runner.time_ms(feeds, 0, block))
            reference.add(time_call_ms(forward, 0, block))
        return Measurement(batch, seq, past, engine, reference)


def _blocks(repeats: int) -> list[int]:
    """`repeats` split into up to BLOCKS near-equal blocks."""
    count = min(BLOCKS, repeats)
    return [repeats // count + (1 if i < repeats % count else 0) for i in range(count)]


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


def _samples_table(measurements: list[Measurement], engine_label: str) -> pd.DataFrame:
    rows = [{"engine": label, "batch": m.batch, "seq": m.seq, "past": m.past, "iteration": i, "ms": ms}
            for m in measurements
            for label, samples in ((engine_label, m.engine), (REFERENCE, m.reference))
            for i, ms in enumerate(samples.samples_ms)]
    return pd.DataFrame(rows, columns=["engine", "batch", "seq", "past", "iteration", "ms"])


def _plot(measurements: list[Measurement], engine_label: str, path: Path) -> None:
    """Box plots of the raw samples, engine next to reference, one pair per shape point."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(max(6.0, 1.6 * len(measurements)), 4.0))
    ax = fig.subplots()
    labels = [f"b{m.batch} s{m.seq}" + (f" p{m.past}" if m.past else "") for m in measurements]
    centres = np.arange(len(measurements)) * 3.0
    for offset, colour, label, pick in ((-0.5, "tab:blue", engine_label, lambda m: m.engine),
                                        (0.5, "tab:orange", REFERENCE, lambda m: m.reference)):
        boxes = ax.boxplot([pick(m).samples_ms for m in measurements], positions=centres + offset, widths=0.8,
                           patch_artist=True, showfliers=True)
        for box in boxes["boxes"]:
            box.set_facecolor(colour)
        boxes["boxes"][0].set_label(label)
    ax.set_xticks(centres, labels)
    ax.set_yscale("log")
    ax.set_ylabel("latency (ms)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
