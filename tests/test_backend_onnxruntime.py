"""The ONNX Runtime backend: an offline-optimized model tied to this CPU, loaded back as a runner."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx.reference import ReferenceEvaluator

from tasks.backends.base import BackendUnavailable
from tasks.backends.onnxruntime.backend import SIDECAR, OnnxRuntimeBackend, cpu_isa
from tasks.config.spec import OnnxRuntimeTarget
from tests.fixtures.onnx_graphs import write_mlp

CPU = OnnxRuntimeTarget(name="cpu", backend="onnxruntime", threads=1)


def built(tmp_path: Path, target: OnnxRuntimeTarget = CPU, *, external_data: bool = False) -> tuple[Path, Path]:
    source = write_mlp(tmp_path / "model.onnx", external_data=external_data)
    out = tmp_path / "engine"
    out.mkdir()
    OnnxRuntimeBackend().build(source, target, [], out, tmp_path / "cache")
    return source, out


def test_build_saves_an_optimized_model_and_records_how(tmp_path: Path) -> None:
    source, out = built(tmp_path)
    optimized = onnx.load(str(out / "model.onnx"))
    assert [n.op_type for n in optimized.graph.node] != [n.op_type for n in onnx.load(str(source)).graph.node]
    sidecar = json.loads((out / SIDECAR).read_text())
    assert sidecar["hardware"] == cpu_isa()
    assert sidecar["hardware"]["arch"].startswith("cpu-")
    assert sidecar["session_options"]["graph_optimization_level"] == "ORT_ENABLE_ALL"
    assert sidecar["session_options"]["intra_op_num_threads"] == 1
    assert sidecar["providers"] == ["CPUExecutionProvider"]
    assert sidecar["engine_bytes"] == (out / "model.onnx").stat().st_size


def test_runner_matches_the_source_model(tmp_path: Path) -> None:
    source, out = built(tmp_path)
    x = np.random.default_rng(1).standard_normal((3, 16)).astype(np.float32)
    expected = ReferenceEvaluator(str(source)).run(None, {"x": x})[0]
    with OnnxRuntimeBackend().load(out, CPU) as runner:
        assert runner.input_names == ["x"] and runner.output_names == ["y"]
        got = runner.infer({"x": x, "attention_mask": np.ones((3, 4), dtype=np.int64)})["y"]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-4)


def test_runner_names_a_missing_input(tmp_path: Path) -> None:
    _, out = built(tmp_path)
    with OnnxRuntimeBackend().load(out, CPU) as runner, pytest.raises(ValueError, match=r"missing inputs \['x'\]"):
        runner.infer({"input_ids": np.zeros((1, 4), dtype=np.int64)})


def test_engine_optimized_for_another_cpu_is_refused(tmp_path: Path) -> None:
    _, out = built(tmp_path)
    sidecar = json.loads((out / SIDECAR).read_text())
    sidecar["hardware"]["isa"] = ["amx_tile", "amx_int8"]
    (out / SIDECAR).write_text(json.dumps(sidecar))
    with pytest.raises(BackendUnavailable, match="rebuild it here"):
        OnnxRuntimeBackend().load(out, CPU)


def test_model_with_external_data_builds_and_runs(tmp_path: Path) -> None:
    source, out = built(tmp_path, external_data=True)
    assert (out / "model.onnx.data").is_file()
    x = np.ones((2, 16), dtype=np.float32)
    with OnnxRuntimeBackend().load(out, CPU) as runner:
        np.testing.assert_allclose(runner.infer({"x": x})["y"], ReferenceEvaluator(str(source)).run(None, {"x": x})[0],
                                   rtol=1e-5, atol=1e-4)


def test_optimization_level_zero_keeps_the_graph(tmp_path: Path) -> None:
    source, out = built(tmp_path, CPU.model_copy(update={"optimization_level": 0}))
    assert json.loads((out / SIDECAR).read_text())["session_options"]["graph_optimization_level"] == "ORT_DISABLE_ALL"
    assert [n.op_type for n in onnx.load(str(out / "model.onnx")).graph.node] == ["MatMul", "Add", "Relu", "MatMul"]


def test_int8_builds_from_the_cpu_graph_and_the_other_precisions_from_the_neutral_one() -> None:
    assert [CPU.source_graph(p) for p in ("fp32", "fp16", "int8")] == ["neutral", "neutral", "cpu"]


def test_cpu_isa_reads_arm_features(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nFeatures\t: fp asimd asimddp sve i8mm bf16\nCPU part\t: 0xd40\n")
    assert cpu_isa(cpuinfo)["isa"] == ["asimd", "asimddp", "sve", "i8mm", "bf16"]


def _matmul_chain(path: Path, width: int = 512, depth: int = 8) -> Path:
    """Products large enough that ONNX Runtime splits them over its intra-op pool."""
    from onnx import TensorProto, helper, numpy_helper

    weight = numpy_helper.from_array(np.random.default_rng(0).random((width, width), dtype=np.float32), "w")
    nodes, previous = [], "x"
    for i in range(depth):
        nodes.append(helper.make_node("MatMul", [previous, "w"], [f"y{i}"]))
        previous = f"y{i}"
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, width])],
                              [helper.make_tensor_value_info(previous, TensorProto.FLOAT, [None, width])], [weight])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def test_an_engines_thread_pool_stops_spinning_when_its_call_returns(tmp_path: Path) -> None:
    """Between calls the engine takes no CPU: an idle pool that spins on (ONNX Runtime's default, tens of ms
    to seconds) takes a core from whatever runs next, in a benchmark the next engine or the reference."""
    import os
    import time

    target = OnnxRuntimeTarget(name="cpu", backend="onnxruntime", threads=2)
    out = tmp_path / "engine"
    out.mkdir()
    OnnxRuntimeBackend().build(_matmul_chain(tmp_path / "chain.onnx"), target, [], out, tmp_path / "cache")
    assert json.loads((out / SIDECAR).read_text())["session_options"]["config_entries"] == {
        "session.force_spinning_stop": "1"}
    runner = OnnxRuntimeBackend().load(out, target)
    feeds = {"x": np.random.default_rng(1).random((64, 512), dtype=np.float32)}
    idle_cpu = 0.0
    for _ in range(10):
        runner.infer(feeds)
        before = os.times()
        time.sleep(0.1)
        after = os.times()
        idle_cpu += (after.user + after.system) - (before.user + before.system)
    runner.close()
    assert idle_cpu < 0.05, f"{idle_cpu:.3f} s of CPU in 1 s of idle time between calls"
