"""The pipelines.yaml schema: what a user may declare, and nothing else.

Pydantic models and their bounds only: reading YAML and locating errors is tasks.config.loader's,
looking at files and the environment is tasks.config.preflight's. Types are strict (`true` is not 1,
1e20 is not an integer), numbers finite and bounded. The target union is built from the backend
registry (tasks.backends.table), so an installed backend plugin's settings are part of it.
"""

from __future__ import annotations

import difflib
import functools
import importlib.util
import os
import re
import zoneinfo
from pathlib import Path
from typing import Annotated, Any, Literal, Union
from urllib.parse import urlsplit

import httpx
from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator,
                      model_validator)

from tasks.backends.base import TargetSpec
from tasks.backends.table import BACKENDS
from tasks.config.bounds import (MAX_BATCH, MAX_BENCHMARK_SECONDS, MAX_GPUS_PER_HOST, MAX_PATTERNS, MAX_PROFILES,
                                 MAX_RETRIES, MAX_ROUNDS, MAX_SAMPLES, MAX_SEQ, MAX_SLO_MS, MAX_TARGETS, MAX_THREADS,
                                 MAX_THRESHOLD, MAX_TIMEOUT_S, MAX_TOKENS_PER_DAY, MAX_TOLERANCE, MAX_WARMUP,
                                 MAX_WORKER_TIMEOUT_S, NAME, PRECISIONS, Pattern)
from tasks.config.bounds import Strict as _Strict
from tasks.config.points import default_gate_point
from tasks.config.profiles import ProfileSpec
from tasks.config.yaml_source import clip, shown
from tasks.measure import capacity as _capacity
from tasks.measure.hostload import CONTENDED_SHARE
from tasks.measure.rounds import SLOT_MS
from tasks.measure.stats import MIN_ROUNDS
from tasks.runtime.redact import redacted_url

TASKS = ("feature-extraction", "text-classification", "text-generation", "text-generation-with-past")
DECODER_TASKS = ("text-generation", "text-generation-with-past")
KV_CACHE_TASKS = ("text-generation-with-past",)
PACKAGE_SCHEME = "package://"
# The accuracy gates int8's accuracy fallback can check on calibration data (tasks/stages/int8_fallback.py measures them).
FALLBACK_GATED = {"encoder": ("cosine_mean", "cosine_min"), "decoder": ("top1_agreement",)}


class ModelSpec(_Strict):
    """Where the weights come from: a hub id, or a local directory (which wins when both are set)."""

    id: str | None = Field(None, max_length=96, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9_.-]+)?$",
                           description="HuggingFace Hub id, loaded from the hub when no path")
    path: str | None = Field(None, min_length=1, max_length=4096,
                             description="local directory, or package://<module>/<subdir>")
    revision: str = Field("main", min_length=1, max_length=256, pattern=r"^[^\s]+$", description="hub revision")
    task: Literal[TASKS] = Field(description="Optimum export task")  # type: ignore[valid-type]

    @model_validator(mode="after")
    def _needs_source(self) -> ModelSpec:
        if not self.id and not self.path:
            raise ValueError("either 'id' (a hub id) or 'path' (a local directory) is required")
        return self

    @property
    def is_decoder(self) -> bool:
        return self.task in DECODER_TASKS

    @property
    def has_past(self) -> bool:
        return self.task in KV_CACHE_TASKS

    @property
    def named(self) -> str:
        """The model as MLflow tags and registry descriptions name it: its hub id, else its path as written."""
        return self.id or self.path or ""


class ExportSpec(_Strict):
    opset: int = Field(18, ge=14, le=23, description="ONNX opset (18 is the lowest Optimum recommends for Llama)")


class CalibrationSpec(_Strict):
    data: str = Field("data/calibration.txt", min_length=1, max_length=4096,
                      description="real text, one sample per line")
    samples: int = Field(128, ge=1, le=MAX_SAMPLES, description="lines used for calibration")
    method: Literal["minmax", "entropy", "percentile"] = "minmax"
    seq_len: int = Field(128, ge=1, le=MAX_SEQ, description="tokens per calibration sample")
    batch_size: int = Field(8, ge=1, le=MAX_BATCH, description="samples per calibration forward pass")


class AccuracyFallbackSpec(_Strict):
    max_float_share: float = Field(
        0.2, gt=0, le=1, description="int8 whose accuracy gates fail on calibration.data keeps its most sensitive "
        "nodes float, one at a time, until they pass or this share of the quantizable nodes is float")


@functools.cache
def _onnx_op_types() -> tuple[str, ...]:
    """Every operator name onnx knows (every domain and opset) and ONNX Runtime's own (FusedMatMul, ...), read once."""
    from onnx.defs import get_all_schemas_with_history
    from onnxruntime.capi import _pybind_state

    schemas = [*get_all_schemas_with_history(), *_pybind_state.get_all_operator_schema()]
    return tuple(sorted({schema.name for schema in schemas}))


def _onnx_op_type(name: str) -> str:
    """An op type that is no ONNX operator matches no node: a typo (MatMull) would quietly quantize everything."""
    if name not in _onnx_op_types():
        close = difflib.get_close_matches(name, _onnx_op_types(), n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ValueError(f"unknown op type {shown(name)}; expected an ONNX operator name like MatMul or Gemm{hint}")
    return name


class QuantizationSpec(_Strict):
    accuracy_fallback: AccuracyFallbackSpec | None = Field(
        None, description="keep int8's most sensitive nodes in float until the accuracy gates pass (off when unset)")
    exclude_nodes: list[Pattern] = Field(default_factory=list, max_length=MAX_PATTERNS,
                                         description="node name globs kept in float")
    exclude_op_types: list[Annotated[Pattern, AfterValidator(_onnx_op_type)]] = Field(
        default_factory=list, max_length=MAX_PATTERNS, description="ONNX op types kept in float")
    cpu_format: Literal["dynamic", "qdq-u8s8"] = Field(
        "dynamic", description="the int8 graph ONNX Runtime runs fast on x86"
    )


class OutputTolerance(_Strict):
    atol: float = Field(1e-4, ge=0, le=MAX_TOLERANCE)
    rtol: float = Field(1e-3, ge=0, le=MAX_TOLERANCE)


class ValidationSpec(_Strict):
    atol: float = Field(1e-4, ge=0, le=MAX_TOLERANCE, description="default absolute tolerance, ONNX vs PyTorch")
    rtol: float = Field(1e-3, ge=0, le=MAX_TOLERANCE, description="default relative tolerance")
    outputs: dict[str, OutputTolerance] = Field(default_factory=dict, max_length=1000,
                                                description="per-output override")

    def tolerance(self, output: str) -> OutputTolerance:
        return self.outputs.get(output, OutputTolerance(atol=self.atol, rtol=self.rtol))


class BenchmarkSpec(_Strict):
    batch_sizes: list[Annotated[int, Field(ge=1, le=MAX_BATCH)]] = Field(
        default_factory=lambda: [1, 8], min_length=1, max_length=32)
    seq_lens: list[Annotated[int, Field(ge=1, le=MAX_SEQ)]] = Field(
        default_factory=lambda: [128], min_length=1, max_length=32)
    past_len: int = Field(64, ge=1, le=MAX_SEQ, description="decoders: past length for the decode-step latency")
    warmup: int = Field(5, ge=0, le=MAX_WARMUP, description="untimed calls of each engine before the rounds")
    min_rounds: int = Field(10, ge=3, le=MAX_ROUNDS,
                            description="interleaved rounds before a conclusive interval may stop the rounds")
    max_seconds: float = Field(40.0, gt=0, le=MAX_BENCHMARK_SECONDS,
                               description="time budget of the gate point (the one gates and decisions read); past "
                                           "it, inconclusive; never stops the rounds before min_rounds (and 6)")
    min_seconds: float = Field(3.0, ge=0, le=MAX_BENCHMARK_SECONDS,
                               description="the gate point's rounds span at least this (at most max_seconds): the "
                                           "machine's state lasts seconds, and rounds crowded into less all see one "
                                           "state, so their interval is narrow around a ratio the next run does not repeat")
    survey_seconds: float = Field(8.0, gt=0, le=MAX_BENCHMARK_SECONDS,
                                  description="time budget of every other shape point (reported, never decides)")
    precision: float = Field(0.05, gt=0, le=1, description="stop when every ratio's 95% interval is within ±this")
    threads: int | None = Field(None, ge=1, le=MAX_THREADS, description="intra-op threads; None = all cores")
    contended_above: float = Field(CONTENDED_SHARE, gt=0, le=1,
                                   description="share of all cores other processes may use while engines are timed "
                                               "before the measurement counts as contended and decides nothing; "
                                               "1 never does (a machine whose steady load is known)")

    @model_validator(mode="after")
    def _budget_reaches_min_rounds(self) -> BenchmarkSpec:
        """A round times two engines for a slot each (SLOT_MS, 25 ms): a gate-point budget too short
        for min_rounds (and MIN_ROUNDS) of them is a mistake. (Slower engines: the stage measures on and says so.)"""
        rounds = max(self.min_rounds, MIN_ROUNDS)
        least_ms = rounds * 2 * SLOT_MS  # in milliseconds: the least it names is accepted (6 * 0.05 s is not 0.3)
        if round(self.max_seconds * 1000, 6) < least_ms:
            raise ValueError(f"max_seconds {self.max_seconds:g} cannot fit {rounds} rounds (min_rounds; {MIN_ROUNDS} "
                             f"for a 95% interval) of two engines at {SLOT_MS:g} ms each: give at least "
                             f"{least_ms / 1000:g}")
        return self


class Threshold(_Strict):
    min: float | None = Field(None, ge=-MAX_THRESHOLD, le=MAX_THRESHOLD)
    max: float | None = Field(None, ge=-MAX_THRESHOLD, le=MAX_THRESHOLD)

    @model_validator(mode="after")
    def _one_bound(self) -> Threshold:
        if self.min is None and self.max is None:
            raise ValueError("a threshold needs 'min' or 'max'")
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"min {self.min} is above max {self.max}")
        return self

    def violation(self, value: float) -> str | None:
        """Why `value` fails this threshold, or None when it passes (NaN always fails)."""
        if value != value:
            return "is NaN"
        if self.min is not None and value < self.min:
            return f"{value:.6g} < min {self.min:.6g}"
        if self.max is not None and value > self.max:
            return f"{value:.6g} > max {self.max:.6g}"
        return None


class AccuracySpec(_Strict):
    data: str = Field("data/eval.txt", min_length=1, max_length=4096,
                      description="held-out real text, one sample per line")
    samples: int = Field(64, ge=1, le=MAX_SAMPLES)
    seq_len: int = Field(128, ge=2, le=MAX_SEQ)
    gates: dict[str, Threshold] = Field(default_factory=dict, max_length=32)
    regression_tolerance: float = Field(
        0.01, ge=0, le=1, description="how much worse a gated metric may be than the previous version of the same "
        "(pipeline, precision, target): relative to the previous value (errors below 1 relative to 1)")


class PerformanceSpec(_Strict):
    gates: dict[str, Threshold] = Field(default_factory=dict, max_length=32)
    objective: Literal["throughput", "latency"] = "throughput"
    at: dict[str, Annotated[int, Field(ge=1, le=MAX_SEQ)]] | None = Field(
        None, max_length=2, description="the point gates, objective and decisions read: {batch, seq} (a prefill) or, "
        "for a decoder, {batch, past} (a decode step after benchmark.past_len tokens); default in gate_point")
    min_improvement: float = Field(0.05, ge=0, le=10, description="how much faster than the champion a candidate "
                                   "must be, conclusively, to take the alias")


class CapacitySpec(_Strict):
    """The deployment `smelter capacity` sizes, planned on each candidate's engine card (docs/capacity.md): the
    CLI's options, with its defaults and meanings."""

    tokens_per_day: float = Field(gt=0, le=MAX_TOKENS_PER_DAY, description="N, e.g. 1e9")
    prompt: int = Field(ge=1, le=MAX_SEQ, description="prompt tokens per request")
    answer: int = Field(ge=1, le=MAX_SEQ, description="answer (generated) tokens per request")
    slo_ms: float = Field(gt=0, le=MAX_SLO_MS, description="p99 request latency limit, ms")
    utilisation: float = Field(_capacity.Workload.utilisation, gt=0, le=1, description="target GPU utilisation")
    count: Literal["all", "answer"] = Field(_capacity.Workload.count, description="which tokens N counts: "
                                            "prompt + answer (all) or answer only")
    gpus_per_host: int | None = Field(None, ge=1, le=MAX_GPUS_PER_HOST, description="also answer in hosts")

    def workload(self) -> _capacity.Workload:
        return _capacity.Workload(self.tokens_per_day, self.prompt, self.answer, self.slo_ms, self.utilisation,
                                  self.count, self.gpus_per_host)


def _url_problem(url: str) -> str | None:
    """Why `url` cannot be a webhook, or None; checked here rather than at send time, where the event
    would only stay pending forever."""
    if any(c.isspace() or not c.isprintable() for c in url):
        return "is not a valid URL: it contains spaces or control characters"
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:  # its text may quote the URL: not shown
        return "is not a valid URL: expected host[:port] with a port 1-65535"
    if parts.scheme not in ("http", "https"):
        return f"is not a valid URL for a webhook: expected http:// or https://, got {clip(parts.scheme, 20)!r}"
    if not parts.hostname:
        return "is not a valid URL: it has no host"
    if port == 0:
        return "is not a valid URL: port 0; expected a port 1-65535"
    try:
        httpx.URL(url)
    except httpx.InvalidURL:
        return "is not a valid URL: its host or path cannot be sent to"
    return None


class WebhookSpec(_Strict):
    url: str = Field(max_length=2048)
    secret_env: str = Field(max_length=128, description="environment variable that holds the HMAC secret")
    timeout_s: float = Field(10.0, gt=0, le=MAX_TIMEOUT_S)
    retries: int = Field(3, ge=0, le=MAX_RETRIES)

    @field_validator("url")
    @classmethod
    def _http(cls, url: str) -> str:
        problem = _url_problem(url)
        if problem:
            raise ValueError(f"webhook URL {redacted_url(url)} {problem}")
        return url

    @field_validator("secret_env")
    @classmethod
    def _env_name(cls, name: str) -> str:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise ValueError(f"expected an environment variable name, got {shown(name)}")
        return name


class PromotionSpec(_Strict):
    alias: str = Field("champion", max_length=64, pattern=r"^[A-Za-z][A-Za-z0-9_-]*$")
    webhooks: list[WebhookSpec] = Field(default_factory=list, max_length=16)

    @field_validator("alias")
    @classmethod
    def _not_reserved(cls, alias: str) -> str:
        if alias.lower() == "latest" or re.fullmatch(r"[vV]\d+", alias):
            raise ValueError(f"{alias!r} is reserved by the MLflow registry; pick another alias")
        return alias


class ScheduleSpec(_Strict):
    """When `smelter deploy` runs the pipeline: checked as Prefect's Cron schedule will check it."""

    cron: str = Field(max_length=200)
    timezone: str = Field("UTC", max_length=64)

    @field_validator("cron")
    @classmethod
    def _cron(cls, cron: str) -> str:
        if len(cron.split()) != 5:
            raise ValueError(f"expected a 5-field cron expression (minute hour day month weekday), got {shown(cron)}")
        from prefect.client.schemas.schedules import CronSchedule  # the schedule `smelter deploy` creates

        try:
            CronSchedule(cron=cron)
        except ValidationError as e:
            raise ValueError(f"not a cron expression Prefect accepts: {shown(cron)} "
                             f"({clip(e.errors()[0]['msg'].removeprefix('Value error, '))})") from None
        return cron

    @field_validator("timezone")
    @classmethod
    def _iana(cls, timezone: str) -> str:
        if timezone not in zoneinfo.available_timezones():
            raise ValueError(f"unknown timezone {shown(timezone)}; expected an IANA name like UTC or Europe/Paris")
        return timezone


class FleetSpec(_Strict):
    """How a run spread over work pools waits for their workers (top-level `fleet:`, for every pipeline)."""

    worker_timeout: float = Field(600.0, gt=0, le=MAX_WORKER_TIMEOUT_S,
                                  description="seconds a pool's build may wait for a worker to pick it up; "
                                              "then its candidates fail and the rest of the run goes on")


def _target_union() -> Any:
    """Every registered backend's settings class, told apart by `backend`."""
    classes = tuple(TARGET_CLASSES.values())
    if not classes:
        raise RuntimeError("no engine backend is registered (entry points 'smelter.backends'): install smelter "
                           "(pip install -e .) so its built-in backends register")
    if len(classes) == 1:
        return classes[0]
    return Annotated[Union[classes], Field(discriminator="backend")]  # noqa: UP007 (built from a tuple)


TARGET_CLASSES: dict[str, type[TargetSpec]] = {name: info.target for name, info in BACKENDS.items()}
Target = _target_union()


class PipelineSpec(_Strict):
    name: str = Field(max_length=64, pattern=NAME)
    model: ModelSpec
    export: ExportSpec = ExportSpec()
    profiles: list[ProfileSpec] = Field(min_length=1, max_length=MAX_PROFILES)
    precisions: list[Literal[PRECISIONS]] = Field(min_length=1, max_length=len(PRECISIONS))  # type: ignore[valid-type]
    quantization: QuantizationSpec = QuantizationSpec()
    calibration: CalibrationSpec = CalibrationSpec()
    validation: ValidationSpec = ValidationSpec()
    targets: list[Target] = Field(min_length=1, max_length=MAX_TARGETS)
    accuracy: AccuracySpec = AccuracySpec()
    benchmark: BenchmarkSpec = BenchmarkSpec()
    performance: PerformanceSpec = PerformanceSpec()
    promotion: PromotionSpec = PromotionSpec()
    schedule: ScheduleSpec | None = None
    capacity: CapacitySpec | None = Field(None, description="a deployment to size on each engine card")
    base_dir: Path = Field(Path("."), exclude=True, description="directory of pipelines.yaml")

    @field_validator("capacity")
    @classmethod
    def _plannable(cls, capacity: CapacitySpec | None, info: ValidationInfo) -> CapacitySpec | None:
        """A mix `smelter capacity` could plan: a decoder (measured prefill and decode steps), within its profiles."""
        model, profiles = info.data.get("model"), info.data.get("profiles")
        if capacity is None or model is None or profiles is None:  # their own problems are reported
            return capacity
        if not model.is_decoder:
            raise ValueError(f"needs a decoder (model.task {' or '.join(DECODER_TASKS)}): it is planned on measured "
                             f"prefill and decode steps; got {model.task}")
        beyond = _capacity.limit_problems(capacity.workload(), _capacity.limits_from_profiles(profiles))
        if beyond:
            raise ValueError("; ".join(beyond))
        return capacity

    def resolve(self, path: str) -> Path:
        """A path from the config, relative to pipelines.yaml; package:// paths into site-packages."""
        if path.startswith(PACKAGE_SCHEME):
            return self.package_dir(path) / path[len(PACKAGE_SCHEME):].partition("/")[2]
        resolved = Path(os.path.expanduser(path))
        return resolved if resolved.is_absolute() else self.base_dir / resolved

    @staticmethod
    def package_dir(path: str) -> Path:
        """The installed package a package:// path points into."""
        module = path[len(PACKAGE_SCHEME):].partition("/")[0]
        try:
            found = importlib.util.find_spec(module) if module.isidentifier() else None
        except (ImportError, ValueError):
            found = None
        if found is None or not found.submodule_search_locations:
            raise FileNotFoundError(f"python package {shown(module)} is not installed")
        return Path(list(found.submodule_search_locations)[0])

    @property
    def model_dir(self) -> Path | None:
        return self.resolve(self.model.path) if self.model.path else None

    @property
    def gate_point(self) -> dict[str, int]:
        """The point that performance gates, the objective and decisions read (tasks/config/points.py)."""
        return default_gate_point(self.performance.at, self.performance.objective, self.benchmark.batch_sizes,
                                  self.benchmark.seq_lens[0], self.benchmark.past_len if self.model.has_past else None)

    def candidates(self, precisions: list[str] | None = None, targets: list[str] | None = None) -> list[Candidate]:
        """Every (precision, target) candidate whose backend builds that precision, or those the filters
        name (an empty filter keeps all)."""
        return [Candidate(self.name, p, t.name) for p in self.precisions for t in self.targets
                if t.precision_problem(p) is None
                and (not precisions or p in precisions) and (not targets or t.name in targets)]

    def skipped(self) -> list[tuple[Candidate, str]]:
        """The (precision, target) pairs that are not candidates, each with why."""
        return [(Candidate(self.name, p, t.name), why) for p in self.precisions for t in self.targets
                if (why := t.precision_problem(p))]

    def target(self, name: str) -> TargetSpec:
        return next(t for t in self.targets if t.name == name)

    def calibrated(self, candidate: Candidate) -> bool:
        return calibrated(self.target(candidate.target), candidate.precision)

    def calibrates(self) -> bool:
        return any(self.calibrated(c) for c in self.candidates())

    def fallback_gates(self) -> tuple[dict[str, Threshold], str | None]:
        """(the accuracy gates quantization.accuracy_fallback aims at, why there is none): it can only check on
        calibration data the gates in FALLBACK_GATED. `smelter validate` and the precision stage both ask here."""
        names = FALLBACK_GATED["decoder" if self.model.is_decoder else "encoder"]
        gates = {name: self.accuracy.gates[name] for name in names if name in self.accuracy.gates}
        if gates:
            return gates, None
        return {}, (f"expected an accuracy gate on {' or '.join(names)} (accuracy.gates) to aim at; found "
                    f"{', '.join(self.accuracy.gates) or 'none'}")


class Candidate(BaseModel):
    """One engine to build and judge: (pipeline, precision, target). Its name is used everywhere."""

    model_config = ConfigDict(frozen=True)
    pipeline: str
    precision: str
    target: str

    def __init__(self, pipeline: str, precision: str, target: str):
        super().__init__(pipeline=pipeline, precision=precision, target=target)

    @property
    def name(self) -> str:
        return f"{self.pipeline}/{self.precision}/{self.target}"


class PipelinesFile(_Strict):
    """A checked pipelines file. `warnings` are problems that do not stop the selected pipelines."""

    path: Path
    pipelines: dict[str, PipelineSpec]
    warnings: list[str] = Field(default_factory=list)
    allow_outside_paths: bool = False
    fleet: FleetSpec = FleetSpec()


def calibrated(target: TargetSpec, precision: str) -> bool:
    """Whether an engine of `precision` for `target` is calibrated on calibration.data: int8 graphs, or a target
    calibrating its own build."""
    return precision == "int8" or target.calibrates(precision)


def registered_model_name(pipeline: str, target: str) -> str:
    """The MLflow registered model of one (pipeline, target): its versions, alias and events."""
    return f"{pipeline}-{target}"
