"""Real TensorRT build, run, benchmark timing and three-way comparison on a tiny model (docker image / GPU hosts)."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from tasks.backends.base import BackendUnavailable, EngineMismatch
from tasks.backends.tensorrt import plan as trt_plan
from tasks.backends.tensorrt.target import TensorRTTarget
from tasks.config.spec import ProfileSpec

pytestmark = pytest.mark.tensorrt

GPU = trt_plan.detect_gpu()
if importlib.util.find_spec("tensorrt") is None:
    pytest.skip("TensorRT is not installed (python package 'tensorrt'); run these in the docker/Dockerfile image",
                allow_module_level=True)
if GPU is None:
    pytest.skip("no NVIDIA GPU is visible (nvidia-smi found none)", allow_module_level=True)

from tasks.backends.tensorrt.backend import EngineBuildError, TensorRTBackend  # noqa: E402
from tasks.stages.three_way import compare_three_way  # noqa: E402
from tests.fixtures.onnx_graphs import linear_model  # noqa: E402

PROFILES = [ProfileSpec(batch=[1, 4, 8], seq=[1, 1, 1]), ProfileSpec(batch=[9, 16, 32], seq=[1, 1, 1])]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("trt")
    fp32, fp16 = linear_model(root / "fp32.onnx", False), linear_model(root / "fp16.onnx", True)
    target = TensorRTTarget(name=GPU.arch, backend="tensorrt", arch=GPU.arch, workspace="256MiB", optimization_level=1)
    out = root / "engine"
    out.mkdir()
    facts = TensorRTBackend().build(fp16, target, PROFILES, out, root / "cache")
    return {"root": root, "fp32": fp32, "fp16": fp16, "target": target, "out": out, "facts": facts}


def test_build_writes_engine_and_sidecar(built):
    sidecar = json.loads((built["out"] / trt_plan.SIDECAR).read_text())
    assert (built["out"] / "model.plan").stat().st_size == built["facts"]["engine_bytes"] == sidecar["engine_bytes"]
    assert sidecar["compute_capability"] == GPU.cc and sidecar["gpu_name"] == GPU.name
    assert sidecar["io"] == [{"name": "x", "mode": "input", "dtype": "float32", "shape": [-1, 16]},
                             {"name": "y", "mode": "output", "dtype": "float32", "shape": [-1, 8]}]
    assert [p["x"]["max"] for p in sidecar["profiles"]] == [[8, 16], [32, 16]]
    assert sidecar["layers"]
    assert (built["out"] / trt_plan.TIMING_CACHE_COPY).stat().st_size > 0


def test_second_build_reuses_the_timing_cache(built, tmp_path):
    """The first build starts from no cache and saves one; the same build again loads exactly that cache,
    times nothing new (a hit), and leaves it as it was."""
    first = json.loads((built["out"] / trt_plan.SIDECAR).read_text())["timing_cache"]
    facts = TensorRTBackend().build(built["fp16"], built["target"], PROFILES, tmp_path, built["root"] / "cache")
    second = json.loads((tmp_path / trt_plan.SIDECAR).read_text())["timing_cache"]
    assert first["loaded_bytes"] == 0 and not first["hit"] and first["saved_bytes"] > 0
    assert second["loaded_bytes"] == second["saved_bytes"] == first["saved_bytes"]
    assert second["hit"] and facts["timing_cache_hit"]


def test_runner_matches_onnx_runtime_across_profiles(built):
    import onnxruntime as ort

    session = ort.InferenceSession(str(built["fp16"]), providers=["CPUExecutionProvider"])
    with TensorRTBackend().load(built["out"], built["target"]) as runner:
        for batch in (1, 8, 9, 32):
            x = np.random.default_rng(batch).standard_normal((batch, 16)).astype(np.float32)
            np.testing.assert_allclose(runner.infer({"x": x})["y"], session.run(None, {"x": x})[0], atol=2e-2)
        times = runner.time_ms({"x": np.ones((8, 16), np.float32)}, warmup=3, repeats=10)
    assert len(times) == 10 and all(t > 0 for t in times)


def test_three_way_comparison_at_min_opt_max(built):
    feeds = {point: {"x": np.random.default_rng(b).standard_normal((b, 16)).astype(np.float32)}
             for point, b in (("min", 1), ("opt", 4), ("max", 32))}
    with TensorRTBackend().load(built["out"], built["target"]) as runner:
        report = compare_three_way(built["fp32"], built["fp16"], runner, feeds, atol=0.05, rtol=0.05)
    assert report["passed"], report


def test_engine_from_another_gpu_is_refused_before_loading(built, tmp_path):
    for name in ("model.plan", trt_plan.SIDECAR):
        (tmp_path / name).write_bytes((built["out"] / name).read_bytes())
    sidecar = json.loads((tmp_path / trt_plan.SIDECAR).read_text())
    sidecar["compute_capability"] = "1.0"
    (tmp_path / trt_plan.SIDECAR).write_text(json.dumps(sidecar))
    with pytest.raises(EngineMismatch, match="compute capability differs"):
        TensorRTBackend().load(tmp_path, built["target"])


def test_parser_reports_every_error(tmp_path):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch_size", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch_size", 4])
    nodes = [helper.make_node("NoSuchOp", ["x"], ["a"], domain="smelter.test"),
             helper.make_node("AlsoMissing", ["a"], ["y"], domain="smelter.test")]
    model = helper.make_model(helper.make_graph(nodes, "bad", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("smelter.test", 1)])
    onnx.save(model, tmp_path / "bad.onnx")
    target = TensorRTTarget(name=GPU.arch, backend="tensorrt", arch=GPU.arch)
    with pytest.raises(EngineBuildError, match="could not parse") as caught:
        TensorRTBackend().build(tmp_path / "bad.onnx", target, PROFILES[:1], tmp_path, tmp_path / "cache")
    assert "NoSuchOp" in str(caught.value)


def test_wrong_arch_target_fails_with_both_archs():
    other = "sm75" if GPU.arch != "sm75" else "sm80"
    target = TensorRTTarget(name="other", backend="tensorrt", arch=other)
    with pytest.raises(BackendUnavailable, match=f"target {other} wants compute capability"):
        TensorRTBackend().build(None, target, PROFILES, None, None)
