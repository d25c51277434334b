"""The build stage: one engine per (precision, target), cached by what the engine depends on."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from tasks.backends.base import get_backend
from tasks.config.spec import PipelineSpec, TargetSpec, load
from tasks.config.stage_settings import BuildConfig, CalibrationSource
from tasks.runtime.store import ArtifactStore, StageResult
from tasks.stages.build import BuildUnavailable, build_key, open_engine, run_build, torch_upstream
from tasks.stages.calibration_feeds import prompt_batches
from tests.fixtures.models import write_pipelines
from tests.fixtures.onnx_graphs import write_mlp


def make_spec(**target: object) -> PipelineSpec:
    return PipelineSpec.model_validate({
        "name": "mlp", "model": {"id": "example/mlp", "task": "feature-extraction"},
        "profiles": [{"batch": [1, 2, 4], "seq": [8, 16, 32]}], "precisions": ["fp32", "int8"],
        "targets": [{"name": "cpu", "backend": "onnxruntime", "threads": 1, **target},
                    {"name": "sm90", "backend": "tensorrt", "arch": "sm90"}]})


def precision_output(store: ArtifactStore, tmp_path: Path, *, cpu_graph: bool = False) -> StageResult:
    """A precision stage output holding a real graph (model.cpu.onnx too, as int8 writes it)."""
    source = write_mlp(tmp_path / "source.onnx")
    with store.writing("mlp", "precision", "int8key" if cpu_graph else "fp32key") as w:
        shutil.copy(source, w.dir / "model.onnx")
        if cpu_graph:
            shutil.copy(source, w.dir / "model.cpu.onnx")
        w.outputs["precision"] = "int8" if cpu_graph else "fp32"
    return w.result


def test_build_writes_the_engine_and_is_cached(tmp_path: Path) -> None:
    store, spec = ArtifactStore(tmp_path / "artifacts"), make_spec()
    first = run_build(BuildConfig.of(spec, "cpu", "fp32"), precision_output(store, tmp_path), store)
    assert not first.cached
    assert first.path == store.path("mlp", "build", first.key)
    outputs = first.outputs
    assert outputs["backend"] == "onnxruntime" and outputs["engine_file"] == "model.onnx"
    assert outputs["engine_bytes"] == first.file("model.onnx").stat().st_size > 0
    assert outputs["build_seconds"] >= 0 and outputs["precision"] == "fp32" and outputs["target"] == "cpu"
    assert outputs["hardware"]["isa"] == json.loads(first.file("engine.json").read_text())["hardware"]["isa"]
    again = run_build(BuildConfig.of(spec, "cpu", "fp32"), precision_output(store, tmp_path), store)
    assert again.cached and again.key == first.key
    assert not run_build(BuildConfig.of(spec, "cpu", "fp32"), precision_output(store, tmp_path), store,
                         force=True).cached


def test_key_covers_target_settings_and_upstream(tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path / "artifacts")
    fp32 = precision_output(store, tmp_path)
    backend = get_backend("onnxruntime")
    one_thread, two_threads = make_spec(), make_spec(threads=2)
    key = build_key(fp32, one_thread.target("cpu"), backend, one_thread.profiles)
    assert key == run_build(BuildConfig.of(one_thread, "cpu", "fp32"), fp32, store).key
    assert key != build_key(fp32, two_threads.target("cpu"), backend, two_threads.profiles)
    assert key != build_key(precision_output(store, tmp_path, cpu_graph=True), one_thread.target("cpu"), backend,
                            one_thread.profiles)


def test_a_renamed_target_gets_its_own_engine(tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path / "artifacts")
    fp32 = precision_output(store, tmp_path)
    renamed = PipelineSpec.model_validate(make_spec().model_dump() | {
        "targets": [{"name": "cpu-x86", "backend": "onnxruntime", "threads": 1}]})
    first = run_build(BuildConfig.of(make_spec(), "cpu", "fp32"), fp32, store)
    moved = run_build(BuildConfig.of(renamed, "cpu-x86", "fp32"), fp32, store)
    assert moved.key != first.key and moved.outputs["target"] == "cpu-x86"
    with open_engine(renamed.targets, moved) as runner:
        assert runner.infer({"x": np.ones((2, 16), np.float32)})["y"].shape == (2, 8)


def test_int8_builds_from_the_cpu_graph(tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path / "artifacts")
    int8 = precision_output(store, tmp_path, cpu_graph=True)
    result = run_build(BuildConfig.of(make_spec(), "cpu", "int8"), int8, store)
    assert result.outputs["source_model"] == "model.cpu.onnx"


def test_built_engine_opens_as_a_runner(tmp_path: Path) -> None:
    store, spec = ArtifactStore(tmp_path / "artifacts"), make_spec()
    result = run_build(BuildConfig.of(spec, "cpu", "fp32"), precision_output(store, tmp_path), store)
    with open_engine(spec.targets, result) as runner:
        assert runner.infer({"x": np.ones((2, 16), dtype=np.float32)})["y"].shape == (2, 8)


def test_unavailable_backend_says_why_and_writes_nothing(tmp_path: Path) -> None:
    store, spec = ArtifactStore(tmp_path / "artifacts"), make_spec()
    if get_backend("tensorrt").missing(spec.target("sm90")) is None:
        pytest.skip("this machine can build for sm90 with TensorRT")
    with pytest.raises(BuildUnavailable, match="target sm90 \\(tensorrt\\): cannot build here: .+"):
        run_build(BuildConfig.of(spec, "sm90", "fp32"), precision_output(store, tmp_path), store)
    assert not (store.root / "mlp" / "build").exists()


def test_a_static_fp8_build_depends_on_the_calibration_text_and_reads_whole_prompts(
        tmp_path: Path, tiny_llama_dir: Path) -> None:
    """fp8_scaling static (and fp8_bf16_share) calibrate the graph they compile: editing calibration.data
    rebuilds that engine (its key changes) and no other, and the build is fed whole prompts of real
    tokens (no KV cache)."""
    path = write_pipelines(tmp_path, tiny_llama_dir, "text-generation-with-past", precisions=["bf16", "fp8"],
                           targets=[{"name": "h200", "backend": "inductor", "arch": "sm90", "fp8_scaling": "static"}])
    spec = load(path).pipelines["tiny"]
    static = spec.target("h200")
    per_token = static.model_copy(update={"fp8_scaling": "per-token"})
    sensitive = per_token.model_copy(update={"fp8_bf16_share": 0.1})  # measures sensitivity on the text too

    def upstream(target: TargetSpec, precision: str) -> dict[str, object]:
        return torch_upstream(BuildConfig.of(spec.model_copy(update={"targets": [target]}), "h200", precision))

    before = {"static": upstream(static, "fp8"), "per-token": upstream(per_token, "fp8"),
              "sensitive": upstream(sensitive, "fp8"), "bf16": upstream(static, "bf16")}
    assert before["static"]["calibration"]["samples"] == 16 and "calibration" not in before["per-token"]
    assert before["sensitive"]["calibration"] == before["static"]["calibration"]
    data = tmp_path / "data" / "calibration.txt"
    data.write_text(data.read_text() + "One more line of calibration text.\n")
    assert upstream(static, "fp8") != before["static"]
    assert upstream(sensitive, "fp8") != before["sensitive"]
    assert upstream(per_token, "fp8") == before["per-token"]
    assert upstream(static, "bf16") == before["bf16"]
    feeds = prompt_batches(CalibrationSource.of(spec))
    assert len(feeds) == 4  # 16 samples, 4 per batch
    for batch in feeds:
        assert set(batch) == {"input_ids", "attention_mask"} and batch["input_ids"].shape == (4, 32)
        assert (batch["attention_mask"] == 1).all() and batch["attention_mask"].shape == batch["input_ids"].shape
