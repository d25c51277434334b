"""The onnxruntime backend's declaration and target settings (no onnxruntime import: see table.py)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from tasks.backends.base import TargetSpec
from tasks.config.bounds import MAX_THREADS


class OnnxRuntimeTarget(TargetSpec):
    """The CPU through ONNX Runtime."""

    devices: ClassVar = ("cpu",)
    source: ClassVar = "onnx"
    precisions: ClassVar = ("fp32", "fp16", "int8")
    implementation: ClassVar = "tasks.backends.onnxruntime.backend:OnnxRuntimeBackend"
    graphs: ClassVar = {"int8": "cpu"}  # the neutral int8 graph's Q/DQ pairs are slow on ORT's x86 kernels

    backend: Literal["onnxruntime"]
    optimization_level: int = Field(3, ge=0, le=5, description="0-2 map to ORT's levels, 3+ to all")
    threads: int | None = Field(None, ge=1, le=MAX_THREADS, description="intra-op threads; None = all cores")

    @property
    def intra_op_threads(self) -> int | None:
        return self.threads

    def with_threads(self, threads: int) -> OnnxRuntimeTarget:
        return self.model_copy(update={"threads": threads})
