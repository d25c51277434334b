"""The three-way Polygraphy comparison (FP32 ONNX, precision ONNX, engine), run here with ONNX Runtime as the engine."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from tasks.backends.base import Runner
from tasks.stages.three_way import compare_three_way
from tests.fixtures.onnx_graphs import linear_model


class OnnxRuntimeEngine(Runner):
    """Stands where the TensorRT engine goes on a GPU machine: any Runner works."""

    def __init__(self, path):
        self.session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.output_names = [o.name for o in self.session.get_outputs()]

    def infer(self, feeds):
        return dict(zip(self.output_names, self.session.run(None, feeds)))


def _feeds():
    rng = np.random.default_rng(1)
    return {point: {"x": rng.standard_normal((batch, 16)).astype(np.float32)}
            for point, batch in (("min", 1), ("opt", 4), ("max", 8))}


def test_three_way_report_separates_precision_error_from_engine_error(tmp_path):
    fp32, fp16 = linear_model(tmp_path / "fp32.onnx", False), linear_model(tmp_path / "fp16.onnx", True)
    report = compare_three_way(fp32, fp16, OnnxRuntimeEngine(fp16), _feeds(), atol=0.05, rtol=0.05)
    assert report["passed"] and report["finite"]
    assert report["points"] == ["min", "opt", "max"]
    assert set(report["pairs"]) == {"fp32-vs-precision", "fp32-vs-engine", "precision-vs-engine"}
    precision_error = report["pairs"]["fp32-vs-precision"]["max"]["y"]["max_abs"]
    assert 0 < precision_error < 0.05
    assert report["pairs"]["precision-vs-engine"]["max"]["y"]["max_abs"] == 0


def test_three_way_report_fails_when_tolerance_is_tighter_than_the_cast_error(tmp_path):
    fp32, fp16 = linear_model(tmp_path / "fp32.onnx", False), linear_model(tmp_path / "fp16.onnx", True)
    report = compare_three_way(fp32, fp16, OnnxRuntimeEngine(fp16), _feeds(), atol=1e-7, rtol=1e-7)
    assert not report["passed"]
    assert not report["pairs"]["fp32-vs-precision"]["opt"]["y"]["passed"]
    assert report["pairs"]["precision-vs-engine"]["opt"]["y"]["passed"]


class WrongShapeEngine(OnnxRuntimeEngine):
    """An engine that drops half of every output row, as a bad profile or a broken reshape would."""

    def infer(self, feeds):
        return {name: value[:, :4] for name, value in super().infer(feeds).items()}


def test_engine_output_of_the_wrong_shape_is_a_failed_entry_not_a_crash(tmp_path):
    fp32, fp16 = linear_model(tmp_path / "fp32.onnx", False), linear_model(tmp_path / "fp16.onnx", True)
    report = compare_three_way(fp32, fp16, WrongShapeEngine(fp16), _feeds(), atol=0.05, rtol=0.05)
    assert not report["passed"]
    assert report["pairs"]["fp32-vs-precision"]["opt"]["y"]["passed"]
    for pair in ("fp32-vs-engine", "precision-vs-engine"):
        for point in report["points"]:
            entry = report["pairs"][pair][point]["y"]
            assert entry["passed"] is False and entry["problem"] == "shape mismatch" and entry["max_abs"] is None
