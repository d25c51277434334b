"""The benchmark stage: raw samples for engine and reference, percentiles and speedup derived from them.

Timings themselves are not asserted (two shared cores); what a user relies on is that every figure
is derived from the recorded samples and that both sides were measured at the same points.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import pytest

from tasks.benchmark import PLOT, REFERENCE, SAMPLES, LatencySamples, run_benchmark
from tasks.build import run_build
from tasks.export import run_export
from tasks.spec import PipelineSpec, load
from tasks.store import ArtifactStore, StageResult

REPEATS = 4


def fp32_engine(spec: PipelineSpec, store: ArtifactStore) -> StageResult:
    """Export, take the graph as the fp32 precision output, build it for the cpu target."""
    exported = run_export(spec, store)
    with store.writing(spec.name, "precision", f"fp32-{exported.key}", inputs={"export": exported.key}) as w:
        shutil.copy(exported.file("model.onnx"), w.dir / "model.onnx")
        w.outputs["precision"] = "fp32"
    return run_build(spec, w.result, "cpu", store)


def test_latency_samples_derive_percentiles_and_throughput() -> None:
    samples = LatencySamples()
    samples.add([float(ms) for ms in range(1, 101)])
    summary = samples.summary(batch=4, tokens_per_call=64)
    assert summary["p50_ms"] == pytest.approx(50.5) and summary["p99_ms"] == pytest.approx(99.01)
    assert summary["mean_ms"] == pytest.approx(50.5)
    assert summary["throughput"] == pytest.approx(4 / 0.0505)
    assert summary["tokens_per_s"] == pytest.approx(64 / 0.0505)


def test_encoder_points_keep_raw_samples_for_engine_and_reference(
        pipeline_factory: Callable[..., Path], tiny_bert_dir: Path, tmp_path: Path) -> None:
    spec = load(pipeline_factory(tiny_bert_dir, "feature-extraction",
                                 benchmark={"repeats": REPEATS})).pipelines["tiny"]
    store = ArtifactStore(tmp_path / "artifacts")
    engine = fp32_engine(spec, store)
    result = run_benchmark(spec, engine, store)
    points = result.outputs["points"]
    assert [(p["batch"], p["seq"]) for p in points] == [(1, 16), (2, 16)]
    samples = pd.read_csv(result.file(SAMPLES))
    assert list(samples.columns) == ["engine", "batch", "seq", "past", "iteration", "ms"]
    for point in points:
        assert point["p50_ms"] <= point["p90_ms"] <= point["p99_ms"]
        assert point["reference_p50_ms"] <= point["reference_p99_ms"]
        assert point["speedup_vs_reference"] == pytest.approx(point["reference_p50_ms"] / point["p50_ms"])
        assert point["tokens_per_s"] == pytest.approx(point["throughput"] * point["seq"])
        at_point = samples[(samples["batch"] == point["batch"]) & (samples["seq"] == point["seq"])]
        for label, prefix in (("onnxruntime", ""), (REFERENCE, "reference_")):
            ms = at_point[at_point["engine"] == label]["ms"]
            assert len(ms) == REPEATS
            assert point[f"{prefix}p50_ms"] == pytest.approx(ms.median())
    assert result.outputs["gate_point"] == points[-1]
    assert "decode" not in result.outputs
    assert result.file(PLOT).stat().st_size > 0
    assert run_benchmark(spec, engine, store).cached


def test_decoder_measures_prefill_and_decode_step(pipeline_factory: Callable[..., Path], tiny_llama_dir: Path,
                                                  tmp_path: Path) -> None:
    spec = load(pipeline_factory(tiny_llama_dir, "text-generation-with-past")).pipelines["tiny"]
    store = ArtifactStore(tmp_path / "artifacts")
    result = run_benchmark(spec, fp32_engine(spec, store), store)
    decode = result.outputs["decode"]
    assert [(d["batch"], d["past"]) for d in decode] == [(1, 8), (2, 8)]
    for step in decode:
        assert step["p50_ms"] <= step["p99_ms"]
        assert step["speedup_vs_reference"] == pytest.approx(step["reference_p50_ms"] / step["p50_ms"])
    samples = pd.read_csv(result.file(SAMPLES))
    decode_rows = samples[samples["past"] == 8]
    assert set(decode_rows["seq"]) == {1} and len(decode_rows) == 2 * 2 * spec.benchmark.repeats
    prefill = result.outputs["points"]
    assert all(p["tokens_per_s"] == pytest.approx(p["throughput"] * 16) for p in prefill)

