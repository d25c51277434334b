"""The names the rest of smelter imports for a pipelines file, from where they live.

The schema (pydantic models and bounds) is tasks/config/schema.py, the loader (YAML, located
errors, checks across keys) tasks/config/loader.py, the checks that look at the environment
tasks/config/preflight.py. This module only gathers their public names, so `from tasks.config.spec import
PipelineSpec, load` reads one place; none of those modules imports it.
"""

from __future__ import annotations

from typing import Any

from tasks.backends.base import TargetSpec
from tasks.backends.table import BACKENDS
from tasks.config.bounds import MAX_BATCH, MAX_SEQ, PRECISIONS, arch_number, parse_bytes
from tasks.config.loader import SpecError, load, select
from tasks.config.points import is_decode_point, at_point, point_words
from tasks.config.schema import (DECODER_TASKS, KV_CACHE_TASKS, TARGET_CLASSES, TASKS, AccuracyFallbackSpec,
                                 AccuracySpec, BenchmarkSpec, CalibrationSpec, Candidate, ExportSpec, FleetSpec,
                                 ModelSpec, OutputTolerance, PerformanceSpec, PipelineSpec, PipelinesFile, ProfileSpec,
                                 PromotionSpec, QuantizationSpec, ScheduleSpec, Target, Threshold, ValidationSpec,
                                 WebhookSpec, registered_model_name)

__all__ = ["DECODER_TASKS", "KV_CACHE_TASKS", "MAX_BATCH", "MAX_SEQ", "PRECISIONS", "TARGET_CLASSES", "TASKS",
           "AccuracyFallbackSpec", "AccuracySpec", "BenchmarkSpec", "CalibrationSpec", "Candidate", "ExportSpec",
           "FleetSpec", "ModelSpec", "OutputTolerance", "PerformanceSpec", "PipelineSpec", "PipelinesFile",
           "ProfileSpec", "PromotionSpec", "QuantizationSpec", "ScheduleSpec", "SpecError", "Target", "TargetSpec",
           "Threshold", "ValidationSpec", "WebhookSpec", "arch_number", "is_decode_point", "at_point",
           "load", "parse_bytes", "point_words", "registered_model_name", "select"]


def __getattr__(name: str) -> Any:
    """A registered backend's settings class by its class name (`from tasks.config.spec import TensorRTTarget`),
    looked up in the registry so that no backend is named here."""
    for info in BACKENDS.values():
        if info.target.__name__ == name:
            return info.target
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
