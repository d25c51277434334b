"""The TensorRT decisions that need no GPU: shape ranges, arch and version checks, sidecars, caches."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from tasks.backends.base import EngineMismatch
from tasks.backends.tensorrt import plan as trt_plan
from tasks.backends.tensorrt.target import TensorRTTarget
from tasks.config.spec import ProfileSpec
from tasks.runtime.gpu import GpuInfo

H100 = GpuInfo("NVIDIA H100 80GB HBM3", (9, 0), "580.159.03")
A100 = GpuInfo("NVIDIA A100-SXM4-80GB", (8, 0), "580.159.03")
T4 = GpuInfo("Tesla T4", (7, 5), "535.1")


def _target(**kw) -> TensorRTTarget:
    return TensorRTTarget(**{"name": "sm90", "backend": "tensorrt", "arch": "sm90", **kw})


def _decoder_onnx(path):
    """Inputs named the way Optimum exports a decoder with KV cache."""
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch_size", "sequence_length"]),
              helper.make_tensor_value_info("attention_mask", TensorProto.INT64,
                                            ["batch_size", "past_sequence_length + sequence_length"]),
              helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch_size", "sequence_length"]),
              helper.make_tensor_value_info("past_key_values.0.key", TensorProto.FLOAT,
                                            ["batch_size", 2, "past_sequence_length", 16]),
              helper.make_tensor_value_info("past_key_values.0.value", TensorProto.FLOAT, ["unk__7", 2, None, 16])]
    out = helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch_size", "sequence_length", 32])
    node = helper.make_node("Identity", ["past_key_values.0.key"], ["logits"])
    onnx.save(helper.make_model(helper.make_graph([node], "g", inputs, [out])), path)
    return path


def test_arch_names_round_trip_to_compute_capability():
    assert trt_plan.parse_arch("sm90") == (9, 0)
    assert trt_plan.parse_arch("sm89") == (8, 9)
    assert trt_plan.parse_arch("sm120") == (12, 0)
    assert trt_plan.arch_name((8, 6)) == "sm86"
    with pytest.raises(ValueError, match="sm90"):
        trt_plan.parse_arch("hopper")


def test_build_on_the_wrong_gpu_names_both_archs():
    problem = trt_plan.build_problem(_target(), A100)
    assert problem.startswith("target sm90 wants compute capability 9.0; this machine has NVIDIA A100-SXM4-80GB (8.0)")
    assert trt_plan.build_problem(_target(), H100) is None


def test_build_without_a_gpu_says_so():
    assert "no GPU is visible" in trt_plan.build_problem(_target(), None)


def test_hardware_compatible_target_builds_on_any_ampere_or_newer():
    assert trt_plan.build_problem(_target(hardware_compatibility="ampere_plus"), A100) is None
    assert "Ampere or newer" in trt_plan.build_problem(_target(hardware_compatibility="ampere_plus"), T4)
    assert "wants compute capability 9.0" in trt_plan.build_problem(
        _target(hardware_compatibility="same_compute_capability"), A100)


def _sidecar(**kw):
    return {"tensorrt_version": "10.13.3.9", "compute_capability": "9.0", "gpu_name": H100.name,
            "hardware_compatibility": "none", "version_compatible": False, **kw}


def test_engine_load_refused_on_other_gpu_or_tensorrt():
    assert trt_plan.load_problem(_sidecar(), H100, "10.13.3.9") is None
    assert "cannot load on NVIDIA A100-SXM4-80GB (8.0)" in trt_plan.load_problem(_sidecar(), A100, "10.13.3.9")
    assert "cannot load with TensorRT 11.2.1.2" in trt_plan.load_problem(_sidecar(), H100, "11.2.1.2")
    assert "needs an NVIDIA GPU" in trt_plan.load_problem(_sidecar(), None, "10.13.3.9")


def test_compatible_engines_load_where_their_compatibility_allows():
    portable = _sidecar(hardware_compatibility="ampere_plus", version_compatible=True)
    assert trt_plan.load_problem(portable, A100, "10.16.1.11") is None
    assert "older than Ampere" in trt_plan.load_problem(portable, T4, "10.16.1.11")
    assert "version compatible only with TensorRT 10.x" in trt_plan.load_problem(portable, A100, "11.4.0.106")
    assert "at or above 10.13.3.9" in trt_plan.load_problem(portable, A100, "10.8.0.43")


def test_sidecar_is_checked_before_an_engine_is_loaded(tmp_path):
    with pytest.raises(EngineMismatch, match="engine.json is missing"):
        trt_plan.check_loadable(tmp_path, H100, "10.13.3.9")
    trt_plan.write_sidecar(tmp_path, _sidecar())
    assert trt_plan.check_loadable(tmp_path, H100, "10.13.3.9")["gpu_name"] == H100.name
    with pytest.raises(EngineMismatch, match="compute capability differs"):
        trt_plan.check_loadable(tmp_path, A100, "10.13.3.9")


def test_version_gate_reads_the_major():
    assert trt_plan.trt_major("10.16.1.11") == 10
    assert trt_plan.trt_major("11.4.0.106") == 11


def test_profiles_map_every_decoder_input(tmp_path):
    dims = trt_plan.onnx_input_dims(_decoder_onnx(tmp_path / "m.onnx"))
    assert dims["attention_mask"] == ["batch_size", "past_sequence_length + sequence_length"]
    profiles = [ProfileSpec(batch=[1, 2, 4], seq=[1, 16, 32], past=[1, 64, 128]),
                ProfileSpec(batch=[1, 1, 1], seq=[1, 1, 1], past=[1, 512, 1024])]
    ranges = trt_plan.profile_ranges(dims, profiles)
    assert len(ranges) == 2
    first = ranges[0]
    assert first["input_ids"] == {"min": (1, 1), "opt": (2, 16), "max": (4, 32)}
    assert first["attention_mask"] == {"min": (1, 2), "opt": (2, 80), "max": (4, 160)}
    assert first["past_key_values.0.key"] == {"min": (1, 2, 1, 16), "opt": (2, 2, 64, 16), "max": (4, 2, 128, 16)}
    assert first["past_key_values.0.value"] == first["past_key_values.0.key"]
    assert ranges[1]["past_key_values.0.key"]["max"] == (1, 2, 1024, 16)


def test_profile_without_past_for_a_kv_cache_input_is_an_error(tmp_path):
    dims = trt_plan.onnx_input_dims(_decoder_onnx(tmp_path / "m.onnx"))
    with pytest.raises(ValueError, match=r"is a past length: profiles\[0\] needs 'past"):
        trt_plan.profile_ranges(dims, [ProfileSpec(batch=[1, 2, 4], seq=[1, 16, 32])])


def test_unknown_dynamic_axis_is_named():
    with pytest.raises(ValueError, match="input 'pixel_values' axis 2"):
        trt_plan.profile_ranges({"pixel_values": ["batch", 3, "height", 224]},
                                [ProfileSpec(batch=[1, 2, 4], seq=[1, 16, 32])])


def test_runtime_picks_the_profile_that_holds_the_shapes():
    ranges = [{"x": {"min": [1, 1], "opt": [4, 64], "max": [8, 128]}},
              {"x": {"min": [1, 129], "opt": [1, 256], "max": [2, 512]}}]
    assert trt_plan.choose_profile(ranges, {"x": (8, 128)}) == 0
    assert trt_plan.choose_profile(ranges, {"x": (2, 300)}) == 1
    with pytest.raises(ValueError, match=r"x\[16, 8\]"):
        trt_plan.choose_profile(ranges, {"x": (16, 8)})


def test_timing_cache_is_keyed_by_arch_and_tensorrt_and_saved_atomically(tmp_path):
    path = trt_plan.timing_cache_path(tmp_path, H100, "10.16.1.11")
    assert path.name == "timing-sm90-trt10.16.1.11.cache"
    assert trt_plan.timing_cache_path(tmp_path, A100, "10.16.1.11") != path
    assert trt_plan.read_timing_cache(path) == b""
    trt_plan.save_timing_cache(path, b"abc")
    assert trt_plan.read_timing_cache(path) == b"abc"
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
    assert trt_plan.timing_cache_report(path, b"abc", b"abc")["hit"] is True
    assert trt_plan.timing_cache_report(path, b"", b"abc")["hit"] is False
    assert trt_plan.timing_cache_report(path, b"abc", b"abcdef")["hit"] is False


def test_bfloat16_round_trips_through_its_bits():
    values = np.array([1.0, -2.5, 3.140625, 0.0], dtype=np.float32)
    np.testing.assert_array_equal(trt_plan.from_bfloat16_bits(trt_plan.to_bfloat16_bits(values)), values)
    assert trt_plan.numpy_dtype("HALF") == "float16"
    with pytest.raises(ValueError, match="FP8"):
        trt_plan.numpy_dtype("FP8")


def test_a_timing_cache_hit_is_a_build_that_loaded_a_cache_and_timed_nothing_new(tmp_path) -> None:
    path = tmp_path / "timing.cache"
    assert not trt_plan.timing_cache_report(path, b"", b"saved")["hit"]  # nothing loaded: a cold build
    assert trt_plan.timing_cache_report(path, b"saved", b"saved")["hit"]
    report = trt_plan.timing_cache_report(path, b"saved", b"saved+new")  # new tactics were timed
    assert not report["hit"] and (report["loaded_bytes"], report["saved_bytes"]) == (5, 9)
