"""Three-way check of an engine built from ONNX with Polygraphy's Comparator: FP32 ONNX, the precision graph
it was built from, engine; for the backends that declare it (Backend.compares_three_way: TensorRT's).

Comparing the engine only against PyTorch hides where an error comes from. With ONNX Runtime
running both ONNX graphs, a mismatch between FP32 and precision ONNX is quantization or casting
error; a mismatch between precision ONNX and the engine is the builder's own (TensorRT's tactics, fusions).
Run at the min, opt and max shapes: numeric errors often appear at only some shapes.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from tasks.backends.base import Runner
from tasks.stages.validate import output_stats

PAIRS = (("fp32", "precision"), ("fp32", "engine"), ("precision", "engine"))


def _engine_runner(runner: Runner, name: str, example: dict[str, np.ndarray]):
    """Our Runner seen as a Polygraphy runner, so the engine goes through the same loading checks as everywhere."""
    from polygraphy.backend.base import BaseRunner

    class SmelterRunner(BaseRunner):
        def __init__(self) -> None:
            super().__init__(name=name)

        def activate_impl(self) -> None:
            """The engine is already loaded (and checked against its sidecar) by the backend."""

        def get_input_metadata_impl(self):
            from polygraphy.common import TensorMetadata

            meta = TensorMetadata()
            for input_name in runner.input_names:
                meta.add(input_name, dtype=example[input_name].dtype, shape=[None] * example[input_name].ndim)
            return meta

        def infer_impl(self, feed_dict):
            started = time.perf_counter()
            outputs = runner.infer(dict(feed_dict))
            self.inference_time = time.perf_counter() - started
            return outputs

        def deactivate_impl(self) -> None:
            """The caller owns the runner and closes it."""

    return SmelterRunner()


def compare_three_way(fp32_onnx: Path, precision_onnx: Path, engine: Runner, feeds_by_point: dict[str, dict[str, np.ndarray]],
                      atol: float, rtol: float) -> dict[str, Any]:
    """Per pair, point and output: max/mean/median absolute and max relative error, and whether it passed.

    The engine may be any Runner; tolerances apply to every pair.
    """
    from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx
    from polygraphy.comparator import Comparator, SimpleCompareFunc

    points = list(feeds_by_point)
    runners = [OnnxrtRunner(SessionFromOnnx(str(fp32_onnx), providers=["CPUExecutionProvider"]), name="fp32"),
               OnnxrtRunner(SessionFromOnnx(str(precision_onnx), providers=["CPUExecutionProvider"]), name="precision"),
               _engine_runner(engine, "engine", feeds_by_point[points[0]])]
    results = Comparator.run(runners, data_loader=[feeds_by_point[p] for p in points])
    finite = bool(Comparator.validate(results, check_inf=True, check_nan=True))
    index = {"fp32": 0, "precision": 1, "engine": 2}
    accuracy = Comparator.compare_accuracy(
        results, comparisons=[(index[a], index[b]) for a, b in PAIRS],
        compare_func=SimpleCompareFunc(atol=atol, rtol=rtol, check_error_stat="max"))[0]
    pairs = {f"{a}-vs-{b}": {point: {out: output_stats(result) for out, result in outputs.items()}
                             for point, outputs in zip(points, accuracy[(a, b)])}
             for a, b in PAIRS}
    passed = finite and all(o["passed"] for pt in pairs.values() for outs in pt.values() for o in outs.values())
    return {"passed": passed, "finite": finite, "atol": atol, "rtol": rtol, "points": points, "pairs": pairs}
