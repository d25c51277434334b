"""The pipelines.yaml schema: what a user may declare, checked before any work starts.

Every error names the file, the line, the key and what was expected, so a typo in a nightly
config fails in a second instead of after an hour of exports.
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import httpx
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

PRECISIONS = ("fp32", "fp16", "int8")
TASKS = ("feature-extraction", "text-classification", "text-generation", "text-generation-with-past")
DECODER_TASKS = ("text-generation", "text-generation-with-past")
BACKENDS = ("onnxruntime", "tensorrt")
ENCODER_METRICS = ("cosine_mean", "cosine_min", "max_abs_error")
CLASSIFIER_METRICS = ("label_agreement", "cosine_mean", "cosine_min", "max_abs_error")
DECODER_METRICS = ("top1_agreement", "logit_max_abs_error", "logit_mean_abs_error", "perplexity_delta")
PERFORMANCE_METRICS = ("speedup_vs_reference", "p50_ms", "p90_ms", "p99_ms", "throughput")
PACKAGE_SCHEME = "package://"


class SpecError(Exception):
    """An invalid pipelines.yaml; `problems` are full sentences naming file, line and key."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSpec(_Strict):
    """Where the weights come from: a hub id, or a local directory (which wins when both are set)."""

    id: str | None = Field(None, description="HuggingFace Hub id, loaded from the hub when no path")
    path: str | None = Field(None, description="local directory, or package://<module>/<subdir>")
    revision: str = Field("main", description="hub revision")
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
        return self.task == "text-generation-with-past"


class ExportSpec(_Strict):
    opset: int = Field(18, ge=14, le=23, description="ONNX opset (18 is the lowest Optimum recommends for Llama)")


Dim = Annotated[list[Annotated[int, Field(ge=1)]], Field(min_length=3, max_length=3)]
PastDim = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=3, max_length=3)]


class ProfileSpec(_Strict):
    """One optimization profile: [min, opt, max] for each dynamic dimension."""

    batch: Dim = Field(description="[min, opt, max] batch size")
    seq: Dim = Field(description="[min, opt, max] sequence length (new tokens)")
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


class CalibrationSpec(_Strict):
    data: str = Field("data/calibration.txt", description="real text, one sample per line")
    samples: int = Field(128, ge=1, le=100_000, description="lines used for calibration")
    method: Literal["minmax", "entropy", "percentile"] = "minmax"
    seq_len: int = Field(128, ge=1, description="tokens per calibration sample")
    batch_size: int = Field(8, ge=1, description="samples per calibration forward pass")


class QuantizationSpec(_Strict):
    exclude_nodes: list[str] = Field(default_factory=list, description="node name globs kept in float")
    exclude_op_types: list[str] = Field(default_factory=list, description="op types kept in float")
    cpu_format: Literal["dynamic", "qdq-u8s8"] = Field(
        "dynamic", description="the int8 graph ONNX Runtime runs fast on x86"
    )


class OutputTolerance(_Strict):
    atol: float = Field(1e-4, ge=0)
    rtol: float = Field(1e-3, ge=0)


class ValidationSpec(_Strict):
    atol: float = Field(1e-4, ge=0, description="default absolute tolerance, ONNX vs PyTorch")
    rtol: float = Field(1e-3, ge=0, description="default relative tolerance")
    outputs: dict[str, OutputTolerance] = Field(default_factory=dict, description="per-output override")

    def tolerance(self, output: str) -> OutputTolerance:
        return self.outputs.get(output, OutputTolerance(atol=self.atol, rtol=self.rtol))


class BenchmarkSpec(_Strict):
    batch_sizes: list[Annotated[int, Field(ge=1)]] = Field(default_factory=lambda: [1, 8], min_length=1)
    seq_lens: list[Annotated[int, Field(ge=1)]] = Field(default_factory=lambda: [128], min_length=1)
    past_len: int = Field(64, ge=1, description="decoders: past length for the decode-step latency")
    warmup: int = Field(5, ge=0, description="untimed calls of each engine before the rounds")
    min_rounds: int = Field(10, ge=3, le=10_000, description="interleaved rounds before the stopping rule is checked")
    max_seconds: float = Field(30.0, gt=0, le=3600, description="time budget per shape point; past it, inconclusive")
    precision: float = Field(0.05, gt=0, le=1, description="stop when every ratio's 95% interval is within ±this")
    threads: int | None = Field(None, ge=1, description="intra-op threads; None = all cores")


class Threshold(_Strict):
    min: float | None = None
    max: float | None = None

    @model_validator(mode="after")
    def _one_bound(self) -> Threshold:
        if self.min is None and self.max is None:
            raise ValueError("a threshold needs 'min' or 'max'")
        for name, bound in (("min", self.min), ("max", self.max)):
            if bound is not None and not math.isfinite(bound):
                raise ValueError(f"'{name}' must be a finite number, got {bound}: it would disable the gate")
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
    data: str = Field("data/eval.txt", description="held-out real text, one sample per line")
    samples: int = Field(64, ge=1)
    seq_len: int = Field(128, ge=2)
    gates: dict[str, Threshold] = Field(default_factory=dict)
    regression_tolerance: float = Field(
        0.01, ge=0, le=1, description="how much worse a gated metric may be than the previous version of the same "
        "(pipeline, precision, target): relative to the previous value (errors below 1 relative to 1)")


class PerformanceSpec(_Strict):
    gates: dict[str, Threshold] = Field(default_factory=dict)
    objective: Literal["throughput", "latency"] = "throughput"
    at: dict[str, int] | None = Field(None, description="{batch, seq} the gates and the objective read; default "
                                      "the largest batch (throughput) or the smallest (latency), first seq")
    min_improvement: float = Field(0.05, ge=0, le=10, description="how much faster than the champion a candidate "
                                   "must be, conclusively, to take the alias")


class WebhookSpec(_Strict):
    url: str
    secret_env: str = Field(description="environment variable that holds the HMAC secret")
    timeout_s: float = Field(10.0, gt=0)
    retries: int = Field(3, ge=0, le=10)

    @field_validator("url")
    @classmethod
    def _http(cls, url: str) -> str:
        """Rejected here rather than at send time, where the event would only stay pending forever."""
        if not re.match(r"^https?://[^/\s]+", url):
            raise ValueError(f"expected an http(s) URL, got {url!r}")
        try:
            httpx.URL(url)
        except httpx.InvalidURL as e:
            raise ValueError(f"webhook URL {url!r} is not a valid URL: {e}") from e
        return url

    @field_validator("secret_env")
    @classmethod
    def _env_name(cls, name: str) -> str:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise ValueError(f"expected an environment variable name, got {name!r}")
        return name


class PromotionSpec(_Strict):
    alias: str = Field("champion", pattern=r"^[A-Za-z][A-Za-z0-9_-]*$")
    webhooks: list[WebhookSpec] = Field(default_factory=list)

    @field_validator("alias")
    @classmethod
    def _not_reserved(cls, alias: str) -> str:
        if alias.lower() == "latest" or re.fullmatch(r"[vV]\d+", alias):
            raise ValueError(f"{alias!r} is reserved by the MLflow registry; pick another alias")
        return alias


class ScheduleSpec(_Strict):
    cron: str
    timezone: str = "UTC"

    @field_validator("cron")
    @classmethod
    def _five_fields(cls, cron: str) -> str:
        if len(cron.split()) != 5:
            raise ValueError(f"expected a 5-field cron expression, got {cron!r}")
        return cron


class TargetSpec(_Strict):
    """Where an engine runs: the CPU through ONNX Runtime, or one GPU arch through TensorRT."""

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_-]*$")
    backend: Literal[BACKENDS]  # type: ignore[valid-type]
    arch: str | None = Field(None, pattern=r"^sm\d{2,3}$", description="GPU arch, e.g. sm90")
    optimization_level: int = Field(3, ge=0, le=5)
    workspace: str = Field("4GiB", description="TensorRT workspace pool limit")
    hardware_compatibility: Literal["none", "ampere_plus", "same_compute_capability"] = "none"
    version_compatible: bool = False
    threads: int | None = Field(None, ge=1, description="onnxruntime intra-op threads")
    pool: str | None = Field(None, pattern=r"^[a-z0-9][a-z0-9_-]*$", exclude=True,
                             description="Prefect work pool that builds it (default cpu, or gpu-<arch>); "
                                         "where an engine is built is not part of its key")

    @model_validator(mode="after")
    def _arch_for_gpu(self) -> TargetSpec:
        if self.backend == "tensorrt" and self.arch is None:
            raise ValueError("a tensorrt target needs 'arch' (e.g. sm90)")
        parse_bytes(self.workspace)
        return self

    @property
    def workspace_bytes(self) -> int:
        return parse_bytes(self.workspace)


class PipelineSpec(_Strict):
    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_-]*$")
    model: ModelSpec
    export: ExportSpec = ExportSpec()
    profiles: list[ProfileSpec] = Field(min_length=1)
    precisions: list[Literal[PRECISIONS]] = Field(min_length=1)  # type: ignore[valid-type]
    quantization: QuantizationSpec = QuantizationSpec()
    calibration: CalibrationSpec = CalibrationSpec()
    validation: ValidationSpec = ValidationSpec()
    targets: list[TargetSpec] = Field(min_length=1)
    accuracy: AccuracySpec = AccuracySpec()
    benchmark: BenchmarkSpec = BenchmarkSpec()
    performance: PerformanceSpec = PerformanceSpec()
    promotion: PromotionSpec = PromotionSpec()
    schedule: ScheduleSpec | None = None
    base_dir: Path = Field(Path("."), exclude=True, description="directory of pipelines.yaml")

    def resolve(self, path: str) -> Path:
        """A path from the config, relative to pipelines.yaml; package:// paths into site-packages."""
        if path.startswith(PACKAGE_SCHEME):
            module, _, sub = path[len(PACKAGE_SCHEME):].partition("/")
            found = importlib.util.find_spec(module)
            if found is None or not found.submodule_search_locations:
                raise FileNotFoundError(f"python package {module!r} is not installed")
            return Path(list(found.submodule_search_locations)[0]) / sub
        resolved = Path(os.path.expanduser(path))
        return resolved if resolved.is_absolute() else self.base_dir / resolved

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
        """Every (precision, target) candidate, or those the filters name (an empty filter keeps all)."""
        return [Candidate(self.name, p, t.name) for p in self.precisions for t in self.targets
                if (not precisions or p in precisions) and (not targets or t.name in targets)]

    def target(self, name: str) -> TargetSpec:
        return next(t for t in self.targets if t.name == name)


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
    path: Path
    pipelines: dict[str, PipelineSpec]


def _duplicates(key: str, names: list[str]) -> list[tuple[tuple, str]]:
    dupes = sorted({n for n in names if names.count(n) > 1})
    if not dupes:
        return []
    second = next(i for i, n in enumerate(names) if n in dupes and names.index(n) != i)
    return [((key, second), f"{key}: duplicate names {dupes}")]


def _semantic_problems(spec: PipelineSpec) -> list[tuple[tuple, str]]:
    """Checks that span several keys, each reported at the key a user must change."""
    problems = _duplicates("precisions", list(spec.precisions)) + _duplicates("targets", [t.name for t in spec.targets])
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
    if spec.model.has_past:
        for i, profile in enumerate(spec.profiles):
            if profile.past is None:
                problems.append((("profiles", i), "text-generation-with-past needs 'past: [min, opt, max]'"))
    at = spec.performance.at
    if at is not None and set(at) != {"batch", "seq"}:
        problems.append((("performance", "at"), "expected {batch: N, seq: N}"))
    elif at is not None and (at["batch"] not in spec.benchmark.batch_sizes or at["seq"] not in spec.benchmark.seq_lens):
        problems.append((("performance", "at"), f"{at} is not one of the benchmarked batch_sizes x seq_lens"))
    problems += _outside_profiles(spec)
    return problems


def _outside_profiles(spec: PipelineSpec) -> list[tuple[tuple, str]]:
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


def parse_bytes(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(B|KiB|MiB|GiB|TiB|KB|MB|GB|TB)?\s*", str(text))
    if not match:
        raise ValueError(f"expected a size like '4GiB' or '512MiB', got {text!r}")
    units = {None: 1, "B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40,
             "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
    return int(float(match.group(1)) * units[match.group(2)])


def _merge(base: Any, override: Any) -> Any:
    if isinstance(base, dict) and isinstance(override, dict):
        return {k: _merge(base.get(k), override[k]) if k in base else override[k] for k in override} | {
            k: v for k, v in base.items() if k not in override}
    return override


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key written twice (plain YAML keeps the last one silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first written on line {seen[key]})", key_node.start_mark)
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


class _LineIndex:
    """Maps a key path in the YAML document to the line it was written on."""

    def __init__(self, root: yaml.Node | None):
        self.root = root

    def line(self, loc: tuple[Any, ...]) -> tuple[int | None, bool]:
        """The line of the deepest node on the path, and whether the whole path was found."""
        node, best = self.root, None
        for part in loc:
            if isinstance(node, yaml.MappingNode):
                pair = next(((k, v) for k, v in node.value if k.value == str(part)), None)
                if pair is None:
                    return best or node.start_mark.line + 1, False
                best, node = pair[0].start_mark.line + 1, pair[1]
            elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
                node = node.value[part]
                best = node.start_mark.line + 1
            else:
                return best, False
        return best, True


def _describe(file: Path, lines: _LineIndex, loc: tuple[Any, ...], message: str) -> str:
    key = ".".join(str(p) for p in loc) or "(top level)"
    line, found = lines.line(loc)
    if not found and loc[:1] == ("pipelines",) and len(loc) > 2:
        inherited, from_defaults = lines.line(("defaults", *loc[2:]))
        line = inherited if from_defaults else line
    where = f"{file}:{line}" if line else str(file)
    return f"{where}: {key}: {message}"


def _pydantic_problems(file: Path, lines: _LineIndex, prefix: tuple, err: ValidationError) -> list[str]:
    problems = []
    for e in err.errors():
        loc = prefix + tuple(p for p in e["loc"] if isinstance(p, int) or "[" not in p)
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        elif e["type"] == "missing":
            msg = "required key is missing"
        elif "input" in e and e["type"] not in ("value_error", "assertion_error"):
            msg = f"{msg} (got {e['input']!r})"
        problems.append(_describe(file, lines, loc, msg))
    return problems


def load(path: str | os.PathLike, *, check_env: bool = True) -> PipelinesFile:
    """Read and check pipelines.yaml; raise SpecError listing every problem found."""
    file = Path(path)
    try:
        text = file.read_text()
    except OSError as e:
        raise SpecError([f"{file}: cannot read: {e.strerror}"]) from e
    try:
        lines = _LineIndex(yaml.compose(text, Loader=yaml.SafeLoader))
        doc = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{file}:{mark.line + 1}" if mark else str(file)
        problem = getattr(e, "problem", None) or str(e)
        kind = "" if problem.startswith("duplicate key") else "YAML syntax error: "
        raise SpecError([f"{where}: {kind}{problem}"]) from e
    if not isinstance(doc, dict):
        raise SpecError([f"{file}:1: (top level): expected a mapping with 'pipelines'"])
    unknown = sorted(set(doc) - {"defaults", "pipelines"})
    problems = [_describe(file, lines, (k,), "unknown key; expected 'defaults' or 'pipelines'") for k in unknown]
    defaults = doc.get("defaults") or {}
    pipelines = doc.get("pipelines")
    if not isinstance(defaults, dict):
        problems.append(_describe(file, lines, ("defaults",), "expected a mapping"))
        defaults = {}
    if not isinstance(pipelines, dict) or not pipelines:
        problems.append(_describe(file, lines, ("pipelines",), "expected a non-empty mapping of name: pipeline"))
        raise SpecError(problems)
    parsed: dict[str, PipelineSpec] = {}
    base_dir = file.resolve().parent
    for name, body in pipelines.items():
        if not isinstance(body, dict):
            problems.append(_describe(file, lines, ("pipelines", name), "expected a mapping"))
            continue
        if "name" in body or "base_dir" in body:
            problems.append(_describe(file, lines, ("pipelines", name), "'name'/'base_dir' are set by smelter"))
            continue
        merged = _merge(defaults, body) | {"name": str(name), "base_dir": base_dir}
        try:
            spec = PipelineSpec.model_validate(merged)
        except ValidationError as e:
            problems += _pydantic_problems(file, lines, ("pipelines", name), e)
            continue
        found = _semantic_problems(spec) + _files_problems(spec)
        problems += [_describe(file, lines, ("pipelines", name) + loc, msg) for loc, msg in found]
        if check_env:
            problems += [_describe(file, lines, ("pipelines", name) + loc, msg) for loc, msg in _env_problems(spec)]
        parsed[str(name)] = spec
    if problems:
        raise SpecError(problems)
    return PipelinesFile(path=file, pipelines=parsed)


def _files_problems(spec: PipelineSpec) -> list[tuple[tuple, str]]:
    problems = []
    if spec.model.path:
        try:
            model_dir = spec.model_dir
        except FileNotFoundError as e:
            problems.append((("model", "path"), str(e)))
        else:
            if not (model_dir / "config.json").is_file():
                problems.append((("model", "path"), f"expected a model directory with config.json at {model_dir}"))
    for section, key in (("calibration", "data"), ("accuracy", "data")):
        data = spec.resolve(getattr(getattr(spec, section), key))
        needed = section != "calibration" or any(p == "int8" for p in spec.precisions)
        if needed and not data.is_file():
            problems.append(((section, key), f"expected a text file, {data} does not exist"))
    return problems


def _env_problems(spec: PipelineSpec) -> list[tuple[tuple, str]]:
    return [(("promotion", "webhooks", i, "secret_env"), f"environment variable {hook.secret_env} is not set")
            for i, hook in enumerate(spec.promotion.webhooks) if not os.environ.get(hook.secret_env)]


def select(specs: PipelinesFile, pipelines: list[str], precisions: list[str], targets: list[str]) -> list[Candidate]:
    """The candidates the CLI filters ask for; unknown names are a usage error."""
    for name in pipelines:
        if name not in specs.pipelines:
            raise SpecError([f"{specs.path}: --pipeline {name}: no such pipeline; have {', '.join(specs.pipelines)}"])
    chosen = [c for p in specs.pipelines.values() if not pipelines or p.name in pipelines for c in p.candidates()]
    for flag, wanted, have in (("--precision", precisions, {c.precision for c in chosen}),
                               ("--target", targets, {c.target for c in chosen})):
        for name in wanted:
            if name not in have:
                raise SpecError([f"{specs.path}: {flag} {name}: not declared by the selected pipelines"])
    return [c for p in specs.pipelines.values() if not pipelines or p.name in pipelines
            for c in p.candidates(precisions, targets)]
