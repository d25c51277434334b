"""What each producing stage reads of a pipeline, built from its spec in one place.

A stage's key is made of its settings, so a stage takes these, never the whole PipelineSpec: a key can start
depending on another key of the file only by a field added here, where a reader (and a key test) sees it. The
stages (tasks/stages/) and the graph that hands them their settings (tasks/graph.py) import them; the precision
stage's own settings live with it (tasks/stages/precision.py). The judging steps' settings are
tasks/config/settings.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tasks.backends.base import TargetSpec
from tasks.config.profiles import ProfileSpec
from tasks.config.schema import BenchmarkSpec, CalibrationSpec, ModelSpec, PipelineSpec, ValidationSpec


@dataclass(frozen=True)
class ModelSource:
    """What the loaders read of a pipeline: its name (for messages), its `model:` and the local directory
    that model.path names, resolved against pipelines.yaml (None: the hub)."""

    pipeline: str
    model: ModelSpec
    directory: Path | None

    @classmethod
    def of(cls, spec: PipelineSpec) -> ModelSource:
        return cls(spec.name, spec.model, spec.model_dir)


@dataclass(frozen=True)
class CalibrationSource:
    """What calibration feeds are made of: the model (its tokenizer, and the reference that computes a decoder's
    KV cache), `calibration:` with its text resolved (`data_path`), and the past length decoders with a KV
    cache calibrate at (the first profile's typical one; 0 otherwise)."""

    source: ModelSource
    calibration: CalibrationSpec
    data_path: Path
    past: int

    @classmethod
    def of(cls, spec: PipelineSpec) -> CalibrationSource:
        first = spec.profiles[0]
        past = first.past[1] if spec.model.has_past and first.past else 0
        return cls(ModelSource.of(spec), spec.calibration, spec.resolve(spec.calibration.data), past)


@dataclass(frozen=True)
class ExportConfig:
    """What the export reads of a pipeline: the model and the opset (its key is made of these)."""

    source: ModelSource
    opset: int

    @classmethod
    def of(cls, spec: PipelineSpec) -> ExportConfig:
        return cls(ModelSource.of(spec), spec.export.opset)


@dataclass(frozen=True)
class ValidateConfig:
    """What validation reads of a pipeline: the model, the tolerances, the profiles whose points it compares
    at, and the text it feeds (`data` as written in pipelines.yaml, `data_path` resolved)."""

    source: ModelSource
    validation: ValidationSpec
    profiles: tuple[ProfileSpec, ...]
    data: str
    data_path: Path

    @classmethod
    def of(cls, spec: PipelineSpec) -> ValidateConfig:
        return cls(ModelSource.of(spec), spec.validation, tuple(spec.profiles), spec.accuracy.data,
                   spec.resolve(spec.accuracy.data))


@dataclass(frozen=True)
class BuildConfig:
    """What a build reads of a pipeline: the target and precision it builds for and the profiles its engine
    accepts. A backend that builds from the model itself (`source = "torch"`) also reads the model (the
    others only its pipeline name, for messages) and, where its build calibrates, the calibration feeds
    (`calibration`, else None)."""

    source: ModelSource
    target: TargetSpec
    precision: str | None
    profiles: tuple[ProfileSpec, ...]
    calibration: CalibrationSource | None

    @classmethod
    def of(cls, spec: PipelineSpec, target_name: str, precision: str | None) -> BuildConfig:
        target = spec.target(target_name)
        return cls(ModelSource.of(spec), target, precision, tuple(spec.profiles),
                   CalibrationSource.of(spec) if target.calibrates(precision) else None)


@dataclass(frozen=True)
class AccuracyConfig:
    """What the accuracy stage reads of a pipeline: the model (reference, tokenizer, task), how many lines of
    which held-out text at which length (`accuracy:` without its gates, which only read the metrics), the
    profiles it checks validity at, the targets an engine may be built for (it runs on its own), and the
    validation tolerances a three-way comparison (TensorRT) reports against."""

    source: ModelSource
    samples: int
    seq_len: int
    data_path: Path
    profiles: tuple[ProfileSpec, ...]
    targets: tuple[TargetSpec, ...]
    validation: ValidationSpec

    @classmethod
    def of(cls, spec: PipelineSpec) -> AccuracyConfig:
        return cls(ModelSource.of(spec), spec.accuracy.samples, spec.accuracy.seq_len, spec.resolve(spec.accuracy.data),
                   tuple(spec.profiles), tuple(spec.targets), spec.validation)


@dataclass(frozen=True)
class BenchmarkConfig:
    """What the benchmark reads of a pipeline for one target: the model (the reference it times, its tokenizer
    and task), the target measured (its threads; a GPU one times the reference on the GPU), the targets its
    engines may be built for (each runs on its own), `benchmark:`, the gate point (it reads `performance:`),
    the profiles (the past a KV graph prefills on) and the evaluation text it feeds."""

    source: ModelSource
    target: TargetSpec
    targets: tuple[TargetSpec, ...]
    settings: BenchmarkSpec
    gate_point: dict[str, int]
    profiles: tuple[ProfileSpec, ...]
    data_path: Path

    @classmethod
    def of(cls, spec: PipelineSpec, target_name: str) -> BenchmarkConfig:
        return cls(ModelSource.of(spec), spec.target(target_name), tuple(spec.targets), spec.benchmark,
                   spec.gate_point, tuple(spec.profiles), spec.resolve(spec.accuracy.data))
