"""Triton model-repository entries for promoted TensorRT engines, and their packaging through the serving hook."""

from __future__ import annotations

import pytest

from tasks.backends.tensorrt import plan as trt_plan
from tasks.backends.tensorrt import triton_repository as triton
from tasks.judge import serving

IO = [{"name": "input_ids", "mode": "input", "dtype": "int64", "shape": [-1, -1]},
      {"name": "attention_mask", "mode": "input", "dtype": "int64", "shape": [-1, -1]},
      {"name": "last_hidden_state", "mode": "output", "dtype": "float32", "shape": [-1, -1, 384]}]
PROFILE = {"input_ids": {"min": [1, 1], "opt": [8, 128], "max": [32, 512]},
           "attention_mask": {"min": [1, 1], "opt": [8, 128], "max": [32, 512]}}
POINTS = [{"batch": 1, "seq": 128, "p99_ms": 2.0, "throughput": 500.0},
          {"batch": 8, "seq": 128, "p99_ms": 6.0, "throughput": 1400.0},
          {"batch": 16, "seq": 128, "p99_ms": 11.0, "throughput": 1500.0},
          {"batch": 32, "seq": 128, "p99_ms": 30.0, "throughput": 1700.0}]


def _engine_dir(tmp_path, arch="sm90", cc="9.0", io=IO, profiles=(PROFILE,)):
    engine_dir = tmp_path / arch
    engine_dir.mkdir()
    (engine_dir / "model.plan").write_bytes(f"plan for {arch}".encode())
    trt_plan.write_sidecar(engine_dir, {"target": arch, "arch": arch, "compute_capability": cc, "io": io,
                                        "profiles": list(profiles), "tensorrt_version": "10.16.1.11"})
    return triton.PromotedEngine(engine_dir)


def test_single_engine_entry_has_io_batching_and_plan(tmp_path):
    model_dir = triton.write_triton_repository(tmp_path / "repo", "minilm-sm90", [_engine_dir(tmp_path)], POINTS,
                                               slo_ms=12.0, version=3)
    assert model_dir == tmp_path / "repo" / "minilm-sm90"
    assert (model_dir / "3" / "model.plan").read_bytes() == b"plan for sm90"
    config = (model_dir / "config.pbtxt").read_text()
    assert 'platform: "tensorrt_plan"' in config
    assert "max_batch_size: 32" in config
    assert 'name: "input_ids"\n    data_type: TYPE_INT64\n    dims: [ -1 ]' in config
    assert 'name: "last_hidden_state"\n    data_type: TYPE_FP32\n    dims: [ -1, 384 ]' in config
    assert "preferred_batch_size: [ 8, 16 ]" in config
    assert "cc_model_filenames" not in config


def test_preferred_batch_sizes_meet_the_slo_at_near_best_throughput():
    assert triton.preferred_batch_sizes(POINTS, slo_ms=12.0, limit=32) == [8, 16]
    assert triton.preferred_batch_sizes(POINTS, slo_ms=None, limit=32) == [32]
    assert triton.preferred_batch_sizes(POINTS, slo_ms=None, limit=16) == [8, 16]
    assert triton.preferred_batch_sizes(POINTS, slo_ms=1.0, limit=32) == []


def test_slowest_sequence_length_decides_a_batch_size():
    points = POINTS + [{"batch": 16, "seq": 512, "p99_ms": 40.0, "throughput": 400.0}]
    assert triton.preferred_batch_sizes(points, slo_ms=12.0, limit=32) == [8]


def test_several_arches_share_one_entry_by_compute_capability(tmp_path):
    engines = [_engine_dir(tmp_path, "sm90", "9.0"), _engine_dir(tmp_path, "sm80", "8.0")]
    model_dir = triton.write_triton_repository(tmp_path / "repo", "minilm", engines, POINTS, slo_ms=None)
    assert sorted(p.name for p in (model_dir / "1").iterdir()) == ["model.plan", "model.sm80.plan"]
    assert (model_dir / "1" / "model.sm80.plan").read_bytes() == b"plan for sm80"
    config = (model_dir / "config.pbtxt").read_text()
    assert '{ key: "9.0" value: "model.plan" }' in config
    assert '{ key: "8.0" value: "model.sm80.plan" }' in config


def test_engines_with_different_tensors_cannot_share_an_entry(tmp_path):
    other_io = IO[:1] + IO[2:]
    engines = [_engine_dir(tmp_path, "sm90", "9.0"), _engine_dir(tmp_path, "sm80", "8.0", io=other_io)]
    with pytest.raises(ValueError, match="different inputs/outputs"):
        triton.write_triton_repository(tmp_path / "repo", "minilm", engines, POINTS, slo_ms=None)


def test_max_batch_size_is_what_every_profile_serves():
    small = {name: {"min": [1, 1], "opt": [1, 1024], "max": [4, 2048]} for name in PROFILE}
    assert triton.max_batch_size([PROFILE, small]) == 4
    late = {name: {"min": [2, 1], "opt": [8, 1], "max": [8, 8]} for name in PROFILE}
    with pytest.raises(ValueError, match="batch 1"):
        triton.max_batch_size([late])


def test_latency_slo_comes_from_the_p99_gate():
    from tasks.config.spec import PipelineSpec

    spec = PipelineSpec(name="m", model={"id": "x/y", "task": "feature-extraction"},
                        profiles=[{"batch": [1, 8, 32], "seq": [1, 128, 512]}], precisions=["fp16"],
                        targets=[{"name": "sm90", "backend": "tensorrt", "arch": "sm90"}],
                        performance={"gates": {"p99_ms": {"max": 50}}})
    assert serving.latency_slo_ms(spec.performance.gates) == 50
    assert serving.latency_slo_ms({}) is None


def _promoted(tmp_path, precision, target, engine, backend="tensorrt", status="promoted"):
    from tasks.outcome import CandidateOutcome
    from tasks.config.spec import Candidate
    from tasks.runtime.store import StageResult

    build = StageResult("minilm", "build", target, engine.engine_dir, {"outputs": {"backend": backend}})
    bench = StageResult("minilm", "benchmark", target, tmp_path, {"outputs": {"points": POINTS}})
    return CandidateOutcome(Candidate("minilm", precision, target), status=status,
                            stages={"build": build, "benchmark": bench}, run_id=f"run-{precision}-{target}",
                            model_version="4")


def test_promoted_engines_of_one_run_are_packaged_together(tmp_path):
    from tasks.config.spec import PipelineSpec

    spec = PipelineSpec.model_validate({
        "name": "minilm", "model": {"id": "org/m", "task": "feature-extraction"},
        "profiles": [{"batch": [1, 8, 32], "seq": [1, 128, 512]}], "precisions": ["fp16"],
        "targets": [{"name": "sm90", "backend": "tensorrt", "arch": "sm90"},
                    {"name": "sm80", "backend": "tensorrt", "arch": "sm80"}],
        "accuracy": {"seq_len": 128}, "benchmark": {"seq_lens": [128]},
        "performance": {"gates": {"p99_ms": {"max": 12}}}})
    outcomes = [_promoted(tmp_path, "fp16", "sm90", _engine_dir(tmp_path, "sm90", "9.0")),
                _promoted(tmp_path, "fp16", "sm80", _engine_dir(tmp_path, "sm80", "8.0")),
                _promoted(tmp_path, "fp16", "cpu", _engine_dir(tmp_path, "cpu", "0.0"), backend="onnxruntime"),
                _promoted(tmp_path, "int8", "sm90x", _engine_dir(tmp_path, "sm90x", "9.0"), status="rejected")]
    packages = serving.package_promoted(spec.name, serving.latency_slo_ms(spec.performance.gates), outcomes,
                                       tmp_path / "repo")
    assert set(packages) == {"run-fp16-sm90", "run-fp16-sm80"}
    entry = packages["run-fp16-sm80"]
    assert (entry / "4" / "model.plan").read_bytes() == b"plan for sm80"
    assert (entry / "4" / "model.sm90.plan").read_bytes() == b"plan for sm90"
    config = (entry / "config.pbtxt").read_text()
    assert "cc_model_filenames" in config and "preferred_batch_size: [ 8, 16 ]" in config
