"""Every engine backend smelter knows, in one table: the schema and the loader both read it.

Importing this module imports no runtime (no onnxruntime, tensorrt or torch), so checking a
pipelines file stays fast and works on a machine where a backend is not installed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

PRECISIONS = ("fp32", "fp16", "bf16", "int8", "fp8")


@dataclass(frozen=True)
class BackendInfo:
    """What a backend is, without importing it.

    Args:
        name: the value of a target's `backend:` key.
        module, class_name: where its `Backend` implementation lives (imported on first use).
        devices: the kinds of device its engines run on (`cpu`, `gpu`).
        source: what it builds from: the precision stage's ONNX graph, or the PyTorch model itself.
        precisions: the precisions it can build, a subset of PRECISIONS.
    """

    name: str
    module: str
    class_name: str
    devices: tuple[Literal["cpu", "gpu"], ...]
    source: Literal["onnx", "torch"]
    precisions: tuple[str, ...]


BACKENDS: dict[str, BackendInfo] = {info.name: info for info in (
    BackendInfo("onnxruntime", "tasks.backends.onnxruntime", "OnnxRuntimeBackend", ("cpu",), "onnx",
                ("fp32", "fp16", "int8")),
    BackendInfo("tensorrt", "tasks.backends.tensorrt", "TensorRTBackend", ("gpu",), "onnx",
                ("fp32", "fp16", "int8")),
    BackendInfo("inductor", "tasks.backends.inductor", "InductorBackend", ("gpu", "cpu"), "torch",
                ("fp32", "fp16", "bf16", "fp8")),
)}
