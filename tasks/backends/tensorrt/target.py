"""The tensorrt backend's declaration and target settings (no TensorRT import: see table.py)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, field_validator

from tasks.backends.base import TargetSpec
from tasks.config.bounds import MAX_WORKSPACE_BYTES, Arch, parse_bytes
from tasks.config.yaml_source import shown


class TensorRTTarget(TargetSpec):
    """One NVIDIA GPU arch through TensorRT."""

    devices: ClassVar = ("gpu",)
    source: ClassVar = "onnx"
    precisions: ClassVar = ("fp32", "fp16", "int8")
    implementation: ClassVar = "tasks.backends.tensorrt.backend:TensorRTBackend"
    serving: ClassVar = "tasks.backends.tensorrt.triton_repository:package"

    backend: Literal["tensorrt"]
    arch: Arch
    optimization_level: int = Field(3, ge=0, le=5, description="TensorRT builder optimization level")
    workspace: str | int = Field("4GiB", description="TensorRT workspace pool limit, e.g. 4GiB or bytes")
    hardware_compatibility: Literal["none", "ampere_plus", "same_compute_capability"] = "none"
    version_compatible: bool = False

    @field_validator("workspace")
    @classmethod
    def _workspace(cls, workspace: str | int) -> str | int:
        size = parse_bytes(workspace)
        if not 1 <= size <= MAX_WORKSPACE_BYTES:
            raise ValueError(f"workspace {shown(workspace)} must be between 1 byte and 1TiB")
        return workspace

    @property
    def workspace_bytes(self) -> int:
        return parse_bytes(self.workspace)

    @property
    def gpu_arch(self) -> str:
        return self.arch
