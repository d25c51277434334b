"""What each judging step and each record in MLflow reads of a pipeline, built from its spec in one place.

A gate, a decision, the registry, the summary figure or a candidate's run takes one of these, never the
whole PipelineSpec: its signature says what it depends on, and it can start reading another key only by
a field added here, where a reader sees it. The producing stages' settings are tasks/config/stage_settings.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tasks.backends.base import TargetSpec
from tasks.config.profiles import ProfileSpec
from tasks.config.schema import (CalibrationSpec, Candidate, CapacitySpec, PipelineSpec, QuantizationSpec, Threshold,
                                 WebhookSpec, calibrated, registered_model_name)


@dataclass(frozen=True)
class GateSettings:
    """The bounds a candidate is judged against on its own: `accuracy.gates`, `performance.gates`, and how the
    regression gate compares with the previous version (its tolerance; the eval text as written, for its message)."""

    accuracy: dict[str, Threshold]
    performance: dict[str, Threshold]
    regression_tolerance: float
    eval_data: str

    @classmethod
    def of(cls, spec: PipelineSpec) -> GateSettings:
        return cls(spec.accuracy.gates, spec.performance.gates, spec.accuracy.regression_tolerance, spec.accuracy.data)


@dataclass(frozen=True)
class DecisionSettings:
    """What deciding who takes the alias reads: the targets in the file's order (one decision each), the margin a
    challenger must beat the champion by (`performance.min_improvement`) and the interval width that makes a
    comparison conclusive (`benchmark.precision`)."""

    targets: tuple[str, ...]
    min_improvement: float
    precision: float

    @classmethod
    def of(cls, spec: PipelineSpec) -> DecisionSettings:
        return cls(tuple(t.name for t in spec.targets), spec.performance.min_improvement, spec.benchmark.precision)


@dataclass(frozen=True)
class RegistrySettings:
    """Where a pipeline's engines are registered and announced: one registered model per target (its MLflow
    experiment is named after the pipeline too), the alias that marks production, the webhooks told when it moves."""

    pipeline: str
    targets: tuple[str, ...]
    alias: str
    webhooks: tuple[WebhookSpec, ...]

    @classmethod
    def of(cls, spec: PipelineSpec) -> RegistrySettings:
        return cls(spec.name, tuple(t.name for t in spec.targets), spec.promotion.alias, tuple(spec.promotion.webhooks))

    def model_name(self, target: str) -> str:
        return registered_model_name(self.pipeline, target)


@dataclass(frozen=True)
class RunSettings:
    """What a candidate's MLflow run and its engine card record of the pipeline: the model it names, the targets'
    settings (tags, params; the engine check loads an engine on its own target at the first profile's min shape),
    the int8 and calibration settings (params), the eval and calibration texts (datasets; `calibration_path` is
    None when no candidate calibrates), the gated accuracy metrics shown first, and the `capacity:` deployment
    the card plans within the profiles."""

    pipeline: str
    model: str
    targets: tuple[TargetSpec, ...]
    quantization: QuantizationSpec
    calibration: CalibrationSpec
    calibration_path: Path | None
    eval_path: Path
    eval_samples: int
    gated_accuracy: tuple[str, ...]
    capacity: CapacitySpec | None
    profiles: tuple[ProfileSpec, ...]

    @classmethod
    def of(cls, spec: PipelineSpec) -> RunSettings:
        return cls(spec.name, spec.model.named, tuple(spec.targets), spec.quantization,
                   spec.calibration, spec.resolve(spec.calibration.data) if spec.calibrates() else None,
                   spec.resolve(spec.accuracy.data), spec.accuracy.samples, tuple(spec.accuracy.gates),
                   spec.capacity, tuple(spec.profiles))

    def target(self, name: str) -> TargetSpec:
        return next(t for t in self.targets if t.name == name)

    def calibrated(self, candidate: Candidate) -> bool:
        return calibrated(self.target(candidate.target), candidate.precision)


@dataclass(frozen=True)
class FigureSettings:
    """What the run's summary figure shows besides the outcomes: the pipeline, the alias it stars, the gate point
    its speed is read at and the gates whose bounds it draws."""

    pipeline: str
    alias: str
    gate_point: dict[str, int]
    gates: GateSettings

    @classmethod
    def of(cls, spec: PipelineSpec) -> FigureSettings:
        return cls(spec.name, spec.promotion.alias, spec.gate_point, GateSettings.of(spec))
