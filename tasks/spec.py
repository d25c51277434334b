"""The pipelines.yaml schema: what a user may declare, checked before any work starts.

Every error names the file, the line, the key and what was expected, so a typo in a nightly
config fails in a second instead of after an hour of exports. Types are strict (`true` is not 1,
1e20 is not an integer), numbers finite and bounded, and every value shown in a message is cut
short: the file may come from anyone.
"""

from __future__ import annotations

import importlib.util
import os
import re
import zoneinfo
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import httpx
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tasks import preflight
from tasks.backends.table import BACKENDS, PRECISIONS
from tasks.redact import redacted_url
from tasks.yaml_source import YamlDocument, YamlProblem, clip, key_path, printable, read, shown

TASKS = ("feature-extraction", "text-classification", "text-generation", "text-generation-with-past")
DECODER_TASKS = ("text-generation", "text-generation-with-past")
KV_CACHE_TASKS = ("text-generation-with-past",)
ENCODER_METRICS = ("cosine_mean", "cosine_min", "max_abs_error")
CLASSIFIER_METRICS = ("label_agreement", "cosine_mean", "cosine_min", "max_abs_error")
DECODER_METRICS = ("top1_agreement", "logit_max_abs_error", "logit_mean_abs_error", "perplexity_delta")
PERFORMANCE_METRICS = ("speedup_vs_reference", "p50_ms", "p90_ms", "p99_ms", "throughput")
PACKAGE_SCHEME = "package://"
MAX_PROBLEMS_SHOWN = 20

# Upper bounds: far above any real use, low enough that a typo (1e12, an extra digit) is caught here
# instead of as an out-of-memory kill an hour into a nightly run.
MAX_BATCH = 4096
MAX_SEQ = 262_144
MAX_SAMPLES = 100_000
MAX_WARMUP = 10_000
MAX_ROUNDS = 10_000
MAX_BENCHMARK_SECONDS = 3600.0
MAX_THREADS = 1024
MAX_THRESHOLD = 1e12
MAX_TOLERANCE = 1e3
MAX_WORKSPACE_BYTES = 1 << 40
MAX_TIMEOUT_S = 300.0
MAX_WORKER_TIMEOUT_S = 7 * 24 * 3600.0
MAX_RETRIES = 10
MAX_TARGETS = 64
MAX_PROFILES = 16
MAX_PATTERNS = 10_000
MAX_PROBLEM_CHARS = 1000
NAME = r"^[a-z0-9][a-z0-9_-]*$"


class SpecError(Exception):
    """An invalid pipelines.yaml; `problems` are full sentences naming file, line and key."""

    def __init__(self, problems: list[str]):
        self.problems = [clip(printable(p), MAX_PROBLEM_CHARS) for p in _bounded(problems)]
        super().__init__("\n".join(self.problems))


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


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


class ExportSpec(_Strict):
    opset: int = Field(18, ge=14, le=23, description="ONNX opset (18 is the lowest Optimum recommends for Llama)")


BatchDim = Annotated[list[Annotated[int, Field(ge=1, le=MAX_BATCH)]], Field(min_length=3, max_length=3)]
SeqDim = Annotated[list[Annotated[int, Field(ge=1, le=MAX_SEQ)]], Field(min_length=3, max_length=3)]
PastDim = Annotated[list[Annotated[int, Field(ge=0, le=MAX_SEQ)]], Field(min_length=3, max_length=3)]


class ProfileSpec(_Strict):
    """One optimization profile: [min, opt, max] for each dynamic dimension."""

    batch: BatchDim = Field(description="[min, opt, max] batch size")
    seq: SeqDim = Field(description="[min, opt, max] sequence length (new tokens)")
    past: PastDim | None = Field(None, description="[min, opt, max] past length (0 = prefill), decoders with KV cache")

    @model_validator(mode="after")
    def _ordered(self) -> ProfileSpec:
        for name in ("batch", "seq", "past"):
            lo_opt_hi = getattr(self, name)
            if lo_opt_hi is not None and not lo_opt_hi[0] <= lo_opt_hi[1] <= lo_opt_hi[2]:
                raise ValueError(f"{name} must satisfy min <= opt <= max, got {lo_opt_hi}")
        return self

    def shapes(self) -> dict[str, dict[str, int]]:
        """The three shape points validation and engines must agree on."""
        points = {}
        for i, point in enumerate(("min", "opt", "max")):
            shape = {"batch": self.batch[i], "seq": self.seq[i]}
            if self.past is not None:
                shape["past"] = self.past[i]
            points[point] = shape
        return points


Pattern = Annotated[str, Field(min_length=1, max_length=1000)]


class CalibrationSpec(_Strict):
    data: str = Field("data/calibration.txt", min_length=1, max_length=4096,
                      description="real text, one sample per line")
    samples: int = Field(128, ge=1, le=MAX_SAMPLES, description="lines used for calibration")
    method: Literal["minmax", "entropy", "percentile"] = "minmax"
    seq_len: int = Field(128, ge=1, le=MAX_SEQ, description="tokens per calibration sample")
    batch_size: int = Field(8, ge=1, le=MAX_BATCH, description="samples per calibration forward pass")


class QuantizationSpec(_Strict):
    exclude_nodes: list[Pattern] = Field(default_factory=list, max_length=MAX_PATTERNS,
                                         description="node name globs kept in float")
    exclude_op_types: list[Pattern] = Field(default_factory=list, max_length=MAX_PATTERNS,
                                            description="op types kept in float")
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
                               description="time budget of the gate point (the one gates and decisions read), even "
                                           "before min_rounds; past it, inconclusive")
    survey_seconds: float = Field(8.0, gt=0, le=MAX_BENCHMARK_SECONDS,
                                  description="time budget of every other shape point (reported, never decides)")
    precision: float = Field(0.05, gt=0, le=1, description="stop when every ratio's 95% interval is within ±this")
    threads: int | None = Field(None, ge=1, le=MAX_THREADS, description="intra-op threads; None = all cores")


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
        None, max_length=2, description="{batch, seq} the gates and the objective read; default the largest "
        "batch (throughput) or the smallest (latency), first seq")
    min_improvement: float = Field(0.05, ge=0, le=10, description="how much faster than the champion a candidate "
                                   "must be, conclusively, to take the alias")


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


Arch = Annotated[str, Field(pattern=r"^sm\d{2,3}$", description="GPU arch, e.g. sm90")]


def arch_number(arch: str) -> int:
    """sm89 -> 89: compute capability as one comparable number."""
    return int(arch[2:])


class TargetSpec(_Strict):
    """Where an engine runs. One subclass per backend of the backend table: a pydantic union on
    `backend`, so a setting of another backend is an error and a build key hashes only its own."""

    name: str = Field(max_length=64, pattern=NAME)
    backend: str
    pool: str | None = Field(None, max_length=64, pattern=NAME, exclude=True,
                             description="Prefect work pool that builds it (default cpu, or gpu-<arch>); "
                                         "where an engine is built is not part of its key")

    @property
    def device_kind(self) -> str:
        """`cpu` or `gpu`: where this target's engines run."""
        return BACKENDS[self.backend].devices[0]

    def key_settings(self, precision: str | None) -> dict[str, Any]:
        """The settings an engine of `precision` depends on (what its build key hashes)."""
        return self.model_dump(mode="json")

    def calibrates(self, precision: str) -> bool:
        """Whether this target's build of `precision` reads the calibration text itself (the int8 ONNX
        graphs are calibrated by the precision stage instead)."""
        return False

    def precision_problem(self, precision: str) -> str | None:
        """Why this target cannot build `precision`, or None."""
        built = BACKENDS[self.backend].precisions
        if precision not in built:
            return f"backend {self.backend} does not build {precision} (it builds {', '.join(built)})"
        return None


class OnnxRuntimeTarget(TargetSpec):
    """The CPU through ONNX Runtime."""

    backend: Literal["onnxruntime"]
    optimization_level: int = Field(3, ge=0, le=5, description="0-2 map to ORT's levels, 3+ to all")
    threads: int | None = Field(None, ge=1, le=MAX_THREADS, description="intra-op threads; None = all cores")

    @property
    def arch(self) -> None:
        return None


class TensorRTTarget(TargetSpec):
    """One NVIDIA GPU arch through TensorRT."""

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
    def threads(self) -> None:
        return None


FP8_SETTINGS = ("fp8_exclude", "fp8_scaling", "fp8_bf16_share")  # an inductor target's, read by fp8 builds only


class InductorTarget(TargetSpec):
    """PyTorch's compiler, built from the model itself (torch.export), on a CUDA GPU or the CPU."""

    backend: Literal["inductor"]
    device: Literal["cuda", "cpu"] = "cuda"
    arch: Arch | None = Field(None, description="GPU arch, required with device: cuda")
    format: Literal["compiled", "aoti"] = Field(
        "compiled", description="compiled: exported program + compile cache; aoti: an AOTInductor .pt2 package")
    compile_mode: Literal["max-autotune-no-cudagraphs", "default", "reduce-overhead", "max-autotune"] = Field(
        "max-autotune-no-cudagraphs", description="the prefill's, as torch.compile reads it: max-autotune* autotune, "
        "reduce-overhead and max-autotune replay CUDA graphs (device: cuda)")
    cuda_graphs: bool = Field(True, description="replay the decode step with CUDA graphs (device: cuda)")
    fp8_exclude: list[Pattern] = Field(default_factory=list, max_length=MAX_PATTERNS,
                                       description="an fp8 build's products kept in bf16: globs over "
                                                   "layers.<i>.qkv|o|gate_up|down")
    fp8_scaling: Literal["per-token", "static"] = Field(
        "per-token", description="an fp8 build's activation scales: per-token (computed as each input arrives) "
        "or static (one per product input, calibrated on calibration.data at build: faster; values past the "
        "calibrated range are clipped)")
    fp8_bf16_share: float = Field(
        0.0, ge=0.0, le=0.5, description="an fp8 build keeps in bf16 up to this share of its products' arithmetic: "
        "fp8_exclude's products first, then those whose e4m3 rounding disturbs the logits most per unit of "
        "arithmetic, measured at build on calibration.data")
    threads: int | None = Field(None, ge=1, le=MAX_THREADS, description="intra-op threads (device: cpu)")

    @model_validator(mode="before")
    @classmethod
    def _cpu_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("device") == "cpu" and "cuda_graphs" not in data:
            return {**data, "cuda_graphs": False}
        return data

    @model_validator(mode="after")
    def _device_settings(self) -> InductorTarget:
        if self.device == "cuda":
            if self.arch is None:
                raise ValueError("an inductor target on device cuda needs 'arch' (e.g. sm90)")
            if self.threads is not None:
                raise ValueError("'threads' is a setting of device cpu; this target is on cuda")
        else:
            if self.arch is not None:
                raise ValueError("'arch' is a setting of device cuda; this target is on cpu")
            if self.cuda_graphs:
                raise ValueError("'cuda_graphs' needs device cuda; this target is on cpu")
        return self

    @property
    def device_kind(self) -> str:
        return "gpu" if self.device == "cuda" else "cpu"

    def key_settings(self, precision: str | None) -> dict[str, Any]:
        """The fp8_* settings shape fp8 engines only: another precision's key leaves them out."""
        return self.model_dump(mode="json", exclude=None if precision == "fp8" else set(FP8_SETTINGS))

    def calibrates(self, precision: str) -> bool:
        return precision == "fp8" and (self.fp8_scaling == "static" or self.fp8_bf16_share > 0)

    def precision_problem(self, precision: str) -> str | None:
        if precision == "fp8" and (self.device != "cuda" or arch_number(self.arch or "sm0") < 89):
            return "fp8 needs device cuda with arch sm89 or newer"
        return super().precision_problem(precision)


TARGET_CLASSES: dict[str, type[TargetSpec]] = {
    cls.model_fields["backend"].annotation.__args__[0]: cls  # type: ignore[union-attr]
    for cls in (OnnxRuntimeTarget, TensorRTTarget, InductorTarget)}
Target = Annotated[OnnxRuntimeTarget | TensorRTTarget | InductorTarget, Field(discriminator="backend")]


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
    base_dir: Path = Field(Path("."), exclude=True, description="directory of pipelines.yaml")

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
        """The (batch, seq) that performance gates and the objective read: throughput is judged at the
        largest batch, latency at the smallest, unless `performance.at` says otherwise."""
        pick = max if self.performance.objective == "throughput" else min
        return self.performance.at or {"batch": pick(self.benchmark.batch_sizes), "seq": self.benchmark.seq_lens[0]}

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
        """Whether this candidate's engine is calibrated on calibration.data: int8 graphs, or a target
        calibrating its own build."""
        return candidate.precision == "int8" or self.target(candidate.target).calibrates(candidate.precision)

    def calibrates(self) -> bool:
        return any(self.calibrated(c) for c in self.candidates())


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


Located = tuple[tuple[Any, ...], str]


def _duplicates(key: str, names: list[str]) -> list[Located]:
    dupes = sorted({n for n in names if names.count(n) > 1})
    if not dupes:
        return []
    second = next(i for i, n in enumerate(names) if n in dupes and names.index(n) != i)
    return [((key, second), f"duplicate names {dupes}")]


def _semantic_problems(spec: PipelineSpec) -> list[Located]:
    """Checks that span several keys, each reported at the key a user must change."""
    problems = _duplicates("precisions", list(spec.precisions)) + _duplicates("targets", [t.name for t in spec.targets])
    problems += _gate_problems(spec) + _profile_problems(spec) + _outside_profiles(spec)
    for i, precision in enumerate(spec.precisions):
        reasons = [f"{t.name}: {why}" for t in spec.targets if (why := t.precision_problem(precision))]
        if len(reasons) == len(spec.targets):
            problems.append((("precisions", i), f"no target builds {precision} ({'; '.join(reasons)})"))
    at = spec.performance.at
    if at is not None and set(at) != {"batch", "seq"}:
        problems.append((("performance", "at"), "expected {batch: N, seq: N}"))
    elif at is not None and (at["batch"] not in spec.benchmark.batch_sizes or at["seq"] not in spec.benchmark.seq_lens):
        problems.append((("performance", "at"), f"{at} is not one of the benchmarked batch_sizes x seq_lens"))
    return problems


def _gate_problems(spec: PipelineSpec) -> list[Located]:
    problems: list[Located] = []
    metrics = DECODER_METRICS if spec.model.is_decoder else (
        CLASSIFIER_METRICS if spec.model.task == "text-classification" else ENCODER_METRICS)
    for metric in spec.accuracy.gates:
        if metric not in metrics:
            problems.append((("accuracy", "gates", metric), f"unknown metric for task {spec.model.task}; "
                                                            f"expected one of {', '.join(metrics)}"))
    for metric in spec.performance.gates:
        if metric not in PERFORMANCE_METRICS:
            problems.append((("performance", "gates", metric),
                             f"unknown metric; expected one of {', '.join(PERFORMANCE_METRICS)}"))
    for section, gates in (("accuracy", spec.accuracy.gates), ("performance", spec.performance.gates)):
        for metric, threshold in gates.items():
            bounded = metric.startswith("cosine") or metric.endswith("agreement")
            for bound in (threshold.min, threshold.max):
                if bounded and bound is not None and not 0 <= bound <= 1:
                    problems.append(((section, "gates", metric), f"threshold {bound} is outside [0, 1]"))
                elif not bounded and bound is not None and bound < 0 and metric != "perplexity_delta":
                    problems.append(((section, "gates", metric), f"threshold {bound} must not be negative"))
    return problems


def _profile_problems(spec: PipelineSpec) -> list[Located]:
    problems: list[Located] = []
    for i, profile in enumerate(spec.profiles):
        if spec.model.has_past and profile.past is None:
            problems.append((("profiles", i), "text-generation-with-past needs 'past: [min, opt, max]'"))
        elif not spec.model.has_past and profile.past is not None:
            problems.append((("profiles", i, "past"), f"task {spec.model.task} has no KV cache; 'past' needs "
                                                      "model.task text-generation-with-past"))
    return problems


def _outside_profiles(spec: PipelineSpec) -> list[Located]:
    """Shapes the engine will be asked to run must lie inside some optimization profile."""
    def covered(dim: str, value: int) -> bool:
        return any(getattr(p, dim)[0] <= value <= getattr(p, dim)[2] for p in spec.profiles)

    problems = []
    if not covered("seq", spec.accuracy.seq_len):
        problems.append((("accuracy", "seq_len"), f"{spec.accuracy.seq_len} is outside every profile's seq range"))
    for i, seq in enumerate(spec.benchmark.seq_lens):
        if not covered("seq", seq):
            problems.append((("benchmark", "seq_lens", i), f"{seq} is outside every profile's seq range"))
    for i, batch in enumerate(spec.benchmark.batch_sizes):
        if not covered("batch", batch):
            problems.append((("benchmark", "batch_sizes", i), f"{batch} is outside every profile's batch range"))
    if spec.model.has_past and all(p.past is not None for p in spec.profiles) and not covered("past", spec.benchmark.past_len):
        problems.append((("benchmark", "past_len"), f"{spec.benchmark.past_len} is outside every profile's past range"))
    return problems


def parse_bytes(text: str | int) -> int:
    match = re.fullmatch(r"\s*(\d{1,20}(?:\.\d{1,20})?)\s*(B|KiB|MiB|GiB|TiB|KB|MB|GB|TB)?\s*", str(text))
    if not match or isinstance(text, bool):
        raise ValueError(f"expected a size like '4GiB' or '512MiB', got {shown(text)}")
    units = {None: 1, "B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40,
             "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
    return int(float(match.group(1)) * units[match.group(2)])


def _merge(base: Any, override: Any) -> Any:
    if isinstance(base, dict) and isinstance(override, dict):
        return {k: _merge(base.get(k), override[k]) if k in base else override[k] for k in override} | {
            k: v for k, v in base.items() if k not in override}
    return override


class _Report:
    """Problems found in one pipelines file, each rendered `file:line: key: message`."""

    def __init__(self, file: Path, doc: YamlDocument | None):
        self.file, self.doc = file, doc

    def describe(self, loc: tuple[Any, ...], message: str) -> str:
        line, found = self.doc.line(loc) if self.doc else (None, False)
        if not found and loc[:1] == ("pipelines",) and len(loc) > 2 and self.doc:
            inherited, from_defaults = self.doc.line(("defaults", *loc[2:]))
            line = inherited if from_defaults else line
        where = f"{self.file}:{line}" if line else str(self.file)
        return _redact_urls(f"{where}: {key_path(list(loc))}: {message}")

    def pydantic(self, prefix: tuple, err: ValidationError, data: Any) -> list[str]:
        return [self.describe(*_pydantic_problem(prefix, e, data)) for e in err.errors()]


def _pydantic_problem(prefix: tuple, error: Any, data: Any) -> Located:
    """One pydantic error as (key path, message), in the words of the file rather than of the model.

    Pydantic's path also names union members (`tensorrt`, `str`, `list[int]`); walking it along
    the data the user wrote keeps only the keys and indexes that are really in the file.
    """
    kind = error["type"]
    loc, parts, node, backend = list(error["loc"]), [], data, None
    for i, part in enumerate(loc):
        if isinstance(node, dict) and part in node or isinstance(node, list) and isinstance(part, int) and \
                0 <= part < len(node):
            parts.append(part)
            node = node[part]
        elif isinstance(node, dict) and part in TARGET_CLASSES and node.get("backend") == part:
            backend = part
        elif kind == "missing" and i == len(loc) - 1:
            parts.append(part)
    msg = error["msg"].removeprefix("Value error, ")
    if kind in ("union_tag_not_found", "union_tag_invalid"):
        parts.append("backend")
        msg = (f"unknown backend {shown(error['input'].get('backend'))}; " if kind == "union_tag_invalid" else
               "required key is missing; ") + f"expected one of {', '.join(BACKENDS)}"
    elif kind == "extra_forbidden":
        msg = _foreign_setting(str(parts[-1]), backend) if backend and parts else "unknown key"
    elif kind == "missing":
        msg = "required key is missing"
    elif "input" in error and kind not in ("value_error", "assertion_error"):
        msg = f"{msg} (got {shown(error['input'])})"
    return prefix + tuple(parts), msg


def _foreign_setting(key: str, backend: str) -> str:
    owners = [name for name, cls in TARGET_CLASSES.items() if name != backend and key in cls.model_fields]
    accepted = ", ".join(k for k in TARGET_CLASSES[backend].model_fields if k != "backend")
    owner = f"; it is a setting of {' and '.join(owners)}" if owners else ""
    return f"not a setting of backend {backend}{owner} ({backend} targets take {accepted})"


_URL = re.compile(r"https?://[^\s'\",)\]}]+", re.IGNORECASE)


def _redact_urls(message: str) -> str:
    """Every URL in a message shown redacted: a webhook URL may carry a token in its path or query."""
    return _URL.sub(lambda m: redacted_url(m.group(0)), message)


def load(path: str | os.PathLike, *, pipelines: Sequence[str] | None = None, check_env: bool = True,
         allow_outside_paths: bool = False) -> PipelinesFile:
    """Read and check pipelines.yaml; raise SpecError listing every problem found.

    With `pipelines`, only those must be valid: problems of the others become warnings (a broken
    pipeline must not block another's run) and the broken ones are left out.
    """
    file = Path(path)
    try:
        doc = read(file)
    except OSError as e:
        raise SpecError([f"{file}: cannot read: {e.strerror or e}"]) from e
    except YamlProblem as e:
        where = f"{file}:{e.line}: {e.key}" if e.line else str(file)
        raise SpecError([_redact_urls(f"{where}: {e.message}")]) from e
    report = _Report(file, doc)
    top = doc.data
    if not isinstance(top, dict):
        raise SpecError([report.describe((), "expected a mapping with 'pipelines'")])
    problems = [report.describe((k,), "unknown key; expected 'defaults' or 'pipelines' (or 'fleet')")
                for k in top if k not in ("defaults", "pipelines", "fleet")]
    fleet, fleet_problems = _check_fleet(report, top.get("fleet"))
    problems += fleet_problems
    defaults = top.get("defaults") or {}
    declared = top.get("pipelines")
    if not isinstance(defaults, dict):
        problems.append(report.describe(("defaults",), "expected a mapping"))
        defaults = {}
    if not isinstance(declared, dict) or not declared:
        problems.append(report.describe(("pipelines",), "expected a non-empty mapping of name: pipeline"))
        raise SpecError(problems)
    for name in pipelines or ():
        if name not in declared:
            problems.append(f"{file}: --pipeline {clip(name, 64)}: no such pipeline; have "
                            f"{clip(', '.join(declared))}")
    parsed: dict[str, PipelineSpec] = {}
    warnings: list[str] = []
    base_dir = file.resolve().parent
    for name, body in declared.items():
        found, notes, spec = _check_pipeline(report, name, body, defaults, base_dir, check_env, allow_outside_paths)
        selected = not pipelines or name in pipelines
        if found and not selected:
            warnings += [f"{p} (pipeline {name} is not selected: skipped)" for p in found]
            continue
        problems += found
        warnings += notes
        if spec is not None and not found:
            parsed[name] = spec
    shared, shared_notes = _shared_registered_models(report, parsed, pipelines)
    problems += shared
    warnings += shared_notes
    if problems:
        raise SpecError(problems)
    return PipelinesFile(path=file, pipelines=parsed, allow_outside_paths=allow_outside_paths, fleet=fleet,
                         warnings=[clip(printable(w), MAX_PROBLEM_CHARS) for w in _bounded(warnings)])


def registered_model_name(pipeline: str, target: str) -> str:
    """The MLflow registered model of one (pipeline, target): its versions, alias and events."""
    return f"{pipeline}-{target}"


def _shared_registered_models(report: _Report, parsed: dict[str, PipelineSpec],
                              selected: Sequence[str] | None) -> tuple[list[str], list[str]]:
    """(problems, warnings): targets of two pipelines whose registered model names are the same text
    (`a-b` + `c` and `a` + `b-c`): one model's versions would judge and replace the other's."""
    owners: dict[str, tuple[str, str]] = {}
    problems: list[str] = []
    warnings: list[str] = []
    for name, spec in parsed.items():
        for i, target in enumerate(spec.targets):
            model = registered_model_name(name, target.name)
            first = owners.setdefault(model, (name, target.name))
            if first[0] == name:
                continue
            found = report.describe(("pipelines", name, "targets", i, "name"),
                                    f"registers MLflow model {model!r}, which pipeline {first[0]}'s target "
                                    f"{first[1]} registers too; their versions and alias would mix: rename one")
            chosen = not selected or name in selected or first[0] in selected
            (problems if chosen else warnings).append(found)
    return problems, warnings


def _check_fleet(report: _Report, body: Any) -> tuple[FleetSpec, list[str]]:
    if body is None:
        return FleetSpec(), []
    if not isinstance(body, dict):
        return FleetSpec(), [report.describe(("fleet",), "expected a mapping like {worker_timeout: 600}")]
    try:
        return FleetSpec.model_validate(body), []
    except ValidationError as e:
        return FleetSpec(), report.pydantic(("fleet",), e, body)


def _check_pipeline(report: _Report, name: str, body: Any, defaults: dict, base_dir: Path, check_env: bool,
                    allow_outside_paths: bool) -> tuple[list[str], list[str], PipelineSpec | None]:
    """(problems, warnings, the spec when it validated) for one pipeline of the file."""
    where = ("pipelines", name)
    if not isinstance(body, dict):
        return [report.describe(where, "expected a mapping")], [], None
    if "name" in body or "base_dir" in body:
        return [report.describe(where, "'name'/'base_dir' are set by smelter")], [], None
    merged = _merge(defaults, body) | {"name": name, "base_dir": base_dir}
    try:
        spec = PipelineSpec.model_validate(merged)
    except ValidationError as e:
        return report.pydantic(where, e, merged), [], None
    checks = preflight.check(spec, allow_outside_paths=allow_outside_paths, check_env=check_env)
    problems = _semantic_problems(spec) + checks.problems
    return ([report.describe(where + loc, msg) for loc, msg in problems],
            [report.describe(where + loc, msg) for loc, msg in checks.warnings], spec)


def _bounded(lines: list[str]) -> list[str]:
    """At most MAX_PROBLEMS_SHOWN lines: a file with ten thousand errors gets a readable answer."""
    if len(lines) <= MAX_PROBLEMS_SHOWN:
        return lines
    return lines[:MAX_PROBLEMS_SHOWN] + [f"... and {len(lines) - MAX_PROBLEMS_SHOWN} more"]


def select(specs: PipelinesFile, pipelines: list[str], precisions: list[str], targets: list[str]) -> list[Candidate]:
    """The candidates the CLI filters ask for; unknown names are a usage error."""
    for name in pipelines:
        if name not in specs.pipelines:
            raise SpecError([f"{specs.path}: --pipeline {clip(name, 64)}: no such pipeline; have "
                             f"{clip(', '.join(specs.pipelines))}"])
    chosen = [c for p in specs.pipelines.values() if not pipelines or p.name in pipelines for c in p.candidates()]
    for flag, wanted, have in (("--precision", precisions, {c.precision for c in chosen}),
                               ("--target", targets, {c.target for c in chosen})):
        for name in wanted:
            if name not in have:
                raise SpecError([f"{specs.path}: {flag} {clip(name, 64)}: not a candidate of the selected "
                                 f"pipelines; have {', '.join(sorted(have))}"])
    return [c for p in specs.pipelines.values() if not pipelines or p.name in pipelines
            for c in p.candidates(precisions, targets)]
