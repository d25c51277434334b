"""How many GPUs serve N tokens a day: arithmetic on an engine's measured prefill and decode figures.

The model is deliberately simple so that every number in the answer can be checked by hand:

- A GPU runs one engine and serves requests in batches of `b`: the batch's prompts are prefilled
  together, then `answer` decode steps run at batch `b`. A request's latency is
  `prefill_ms(b) + answer * decode_step_ms(b)`, and `b` is usable only if that is within the SLO.
- `prefill_ms(b) = (measured prefill ms / measured tokens) * b * prompt`: linear in tokens, which holds
  where prefill is compute-bound (at or above the measured token count) and flatters it below.
- `decode_step_ms(b)` is the measured step at that batch; only measured batches are considered.
- A GPU's throughput at `b` is `b * tokens_per_request / latency`; the plan takes the measured
  batch with the highest throughput that meets the SLO, and `GPUs = ceil(N / (86400 * tokens_per_s * utilisation))`.
- Waiting for a batch slot, peaks and failures are what the utilisation headroom pays for;
  they are not modelled.

Pure functions only: figures in, a plan and its markdown out, so the engine card and the CLI say
the same thing and tests run on recorded figures.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

SECONDS_PER_DAY = 86400
PREFILL_METRIC = re.compile(r"^b(\d+)_s(\d+)\.(p99_ms|p50_ms)$")
DECODE_METRIC = re.compile(r"^decode_b(\d+)_p(\d+)\.(p99_ms|p50_ms)$")
PAST_TOLERANCE = 0.25  # warn when the mix's mean context is this far from the measured past


class FiguresError(ValueError):
    """Figures that cannot be planned from; the message names the source, the key and what was expected."""


@dataclass(frozen=True)
class PrefillPoint:
    batch: int
    seq: int
    ms: float


@dataclass(frozen=True)
class DecodePoint:
    batch: int
    past: int
    ms: float


@dataclass(frozen=True)
class Figures:
    """One engine's measured step times; `statistic` says which quantile of per-call time they are."""

    source: str
    statistic: str
    prefill: tuple[PrefillPoint, ...]
    decode: tuple[DecodePoint, ...]
    arch: str | None = None
    unit: str = "GPU"  # what one engine has to itself: a GPU, or for a CPU engine a machine


@dataclass(frozen=True)
class Workload:
    tokens_per_day: float
    prompt: int
    answer: int
    slo_ms: float
    utilisation: float = 0.6
    count: Literal["all", "answer"] = "all"  # which tokens N counts: prompt + answer, or answer only
    gpus_per_host: int | None = None

    def problems(self) -> list[str]:
        checks = [(self.tokens_per_day > 0, "tokens_per_day", "a positive number"),
                  (self.prompt >= 1, "prompt", "an integer >= 1"), (self.answer >= 1, "answer", "an integer >= 1"),
                  (self.slo_ms > 0, "slo_ms", "a positive number of milliseconds"),
                  (0 < self.utilisation <= 1, "utilisation", "a fraction in (0, 1]"),
                  (self.count in ("all", "answer"), "count", "'all' or 'answer'"),
                  (self.gpus_per_host is None or self.gpus_per_host >= 1, "gpus_per_host", "an integer >= 1")]
        return [f"{key}: expected {what}, got {getattr(self, key)!r}" for ok, key, what in checks if not ok]

    @property
    def tokens_per_request(self) -> int:
        return self.prompt + self.answer if self.count == "all" else self.answer


@dataclass(frozen=True)
class Limits:
    """What the pipeline's optimization profiles let the engine run; None = not known (figures from a file)."""

    max_batch: int | None = None
    max_prompt: int | None = None
    max_context: int | None = None


def limits_from_profiles(profiles: list[Any]) -> Limits:
    """The largest batch, prompt (new tokens) and context (past + 1) any optimization profile accepts."""
    pasts = [p.past[2] for p in profiles if getattr(p, "past", None) is not None]
    return Limits(max(p.batch[2] for p in profiles), max(p.seq[2] for p in profiles),
                  max(pasts) + 1 if pasts else None)


@dataclass(frozen=True)
class BatchOption:
    batch: int
    decode_past: int
    prefill_ms: float
    decode_step_ms: float
    latency_ms: float
    meets_slo: bool
    tokens_per_s: float


@dataclass
class CapacityPlan:
    workload: Workload
    figures: Figures
    prefill_basis: PrefillPoint
    options: list[BatchOption]
    chosen: BatchOption | None
    tokens_per_day_per_gpu: float | None
    gpus: int | None
    hosts: int | None
    warnings: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def limit_problems(workload: Workload, limits: Limits) -> list[str]:
    """Where the mix is beyond what the engine's profiles accept: a prompt longer than a call's new tokens, or
    prompt + answer longer than its context. The same words for `smelter capacity` and `smelter validate`."""
    context = workload.prompt + workload.answer
    problems = []
    if limits.max_prompt is not None and workload.prompt > limits.max_prompt:
        problems.append(f"a prompt of {workload.prompt} tokens is beyond the engine's profile "
                        f"(at most {limits.max_prompt} new tokens per call)")
    if limits.max_context is not None and context > limits.max_context:
        problems.append(f"prompt + answer = {context} tokens is beyond the engine's profile "
                        f"(at most {limits.max_context} tokens of context)")
    return problems


def plan(figures: Figures, workload: Workload, limits: Limits = Limits()) -> CapacityPlan:
    """The GPUs (and hosts) that serve `workload` with this engine; gpus is None when no measured batch meets the SLO."""
    problems = workload.problems()
    if problems:
        raise ValueError("capacity: " + "; ".join(problems))
    if not figures.prefill or not figures.decode:
        raise FiguresError(f"{figures.source}: expected at least one prefill and one decode figure")
    beyond = limit_problems(workload, limits)
    if beyond:
        raise ValueError(f"capacity: {beyond[0]}")
    warnings = []
    basis = max(figures.prefill, key=lambda p: p.batch * p.seq)
    per_token_ms = basis.ms / (basis.batch * basis.seq)
    mean_past = workload.prompt + (workload.answer - 1) / 2
    options = []
    for step in sorted(figures.decode, key=lambda d: d.batch):
        if limits.max_batch is not None and step.batch > limits.max_batch:
            warnings.append(f"decode batch {step.batch} is measured but beyond the profile's max batch "
                            f"{limits.max_batch}; not used")
            continue
        prefill_ms = per_token_ms * step.batch * workload.prompt
        latency = prefill_ms + workload.answer * step.ms
        options.append(BatchOption(step.batch, step.past, prefill_ms, step.ms, latency, latency <= workload.slo_ms,
                                   step.batch * workload.tokens_per_request / (latency / 1000)))
        if abs(mean_past - step.past) > PAST_TOLERANCE * step.past:
            warnings.append(f"decode b{step.batch} was measured at past {step.past}; this mix's mean context "
                            f"while decoding is {mean_past:g} tokens, so its step time differs (the KV cache read "
                            "grows with the context)")
    small = [str(o.batch) for o in options if o.batch * workload.prompt < basis.batch * basis.seq]
    if small:
        warnings.append(f"batch {', '.join(small)}: a prefill of fewer than {basis.batch * basis.seq} tokens is "
                        f"scaled down linearly from {basis.batch}x{basis.seq}; a small prefill is less efficient, "
                        "so its time is underestimated")
    usable = [o for o in options if o.meets_slo]
    chosen = max(usable, key=lambda o: o.tokens_per_s, default=None)
    if chosen is None:
        return CapacityPlan(workload, figures, basis, options, None, None, None, None, warnings)
    per_gpu = SECONDS_PER_DAY * chosen.tokens_per_s
    gpus = math.ceil(workload.tokens_per_day / (per_gpu * workload.utilisation))
    hosts = math.ceil(gpus / workload.gpus_per_host) if workload.gpus_per_host else None
    return CapacityPlan(workload, figures, basis, options, chosen, per_gpu, gpus, hosts, warnings)


def markdown(result: CapacityPlan) -> str:
    """The plan with its assumptions and arithmetic, for the terminal and the engine card."""
    w, f, basis = result.workload, result.figures, result.prefill_basis
    unit = f.unit
    counted = "prompt + answer tokens" if w.count == "all" else "answer tokens only"
    lines = ["## Capacity plan", "",
             f"Question: {unit}s{f' ({f.arch})' if f.arch else ''} to serve {w.tokens_per_day:.3g} tokens/day "
             f"({counted}) at {w.prompt} prompt + {w.answer} answer tokens per request, "
             f"request latency <= {w.slo_ms:g} ms (p99 SLO).", "",
             "Assumptions:", "",
             f"- figures: {f.source}, {f.statistic} of per-call time",
             f"- one engine per {unit}; requests served in batches: the batch's prompts prefilled together, then "
             f"{w.answer} decode steps at that batch",
             f"- prefill time linear in tokens: {basis.ms:.4g} ms for {basis.batch}x{basis.seq} = "
             f"{basis.ms / (basis.batch * basis.seq) * 1000:.4g} us/token",
             "- decode step time as measured at each batch (only measured batches are considered)",
             f"- target utilisation {w.utilisation:.0%}: the headroom pays for queueing, peaks and failures, "
             "which are not modelled", "",
             f"| batch | prefill ms | decode step ms (past) | latency ms = prefill + {w.answer} x step | meets SLO "
             f"| tokens/s per {unit} |",
             "|---|---|---|---|---|---|"]
    for o in result.options:
        lines.append(f"| {o.batch} | {o.prefill_ms:.4g} | {o.decode_step_ms:.4g} ({o.decode_past}) | "
                     f"{o.latency_ms:.4g} | {'yes' if o.meets_slo else 'no'} | {o.tokens_per_s:,.0f} |")
    lines.append("")
    if result.chosen is None:
        best = min(result.options, key=lambda o: o.latency_ms, default=None)
        lines.append(f"Answer: **no measured batch meets the SLO** (fastest: {best.latency_ms:.4g} ms at batch "
                     f"{best.batch}); shorten answers, relax the SLO or measure a faster engine."
                     if best else "Answer: **no measured batch is within the profile**.")
    else:
        c = result.chosen
        lines += [f"Arithmetic (batch {c.batch}):", "",
                  f"- tokens/s per {unit} = {c.batch} x {w.tokens_per_request} / {c.latency_ms / 1000:.4g} s = "
                  f"{c.tokens_per_s:,.0f}",
                  f"- tokens/day per {unit} = 86400 x {c.tokens_per_s:,.0f} = {result.tokens_per_day_per_gpu:.4g}",
                  f"- {unit}s = ceil({w.tokens_per_day:.4g} / ({result.tokens_per_day_per_gpu:.4g} x "
                  f"{w.utilisation:g})) = **{result.gpus}**"]
        if result.hosts is not None:
            lines.append(f"- hosts = ceil({result.gpus} / {w.gpus_per_host}) = **{result.hosts}**")
        lines += ["", f"Answer: **{result.gpus} {unit}{'s' if result.gpus != 1 else ''}**"
                  + (f" on {result.hosts} host{'s' if result.hosts != 1 else ''}" if result.hosts is not None else "")
                  + f" at batch {c.batch} (request latency {c.latency_ms:.4g} ms)."]
    if result.warnings:
        lines += ["", "Caveats:", ""] + [f"- {note}" for note in result.warnings]
    return "\n".join(lines) + "\n"


def figures_from_metrics(metrics: dict[str, float], source: str, arch: str | None = None) -> Figures:
    """Figures from a candidate run's metrics (`b8_s512.p99_ms`, `decode_b64_p512.p99_ms`): p99 where logged.
    An engine with no GPU arch is a CPU engine: one per machine."""
    found: dict[str, dict[tuple[int, int], dict[str, float]]] = {"prefill": {}, "decode": {}}
    for name, value in metrics.items():
        for kind, pattern in (("prefill", PREFILL_METRIC), ("decode", DECODE_METRIC)):
            if m := pattern.match(name):
                found[kind].setdefault((int(m[1]), int(m[2])), {})[m[3]] = float(value)
    if not found["prefill"] or not found["decode"]:
        raise FiguresError(f"{source}: expected prefill metrics b<batch>_s<seq>.p99_ms and decode metrics "
                           "decode_b<batch>_p<past>.p99_ms (a decoder engine's benchmark); found "
                           f"{len(found['prefill'])} prefill and {len(found['decode'])} decode points")
    every = [v for points in found.values() for v in points.values()]
    statistic = "p99_ms" if all("p99_ms" in v for v in every) else "p50_ms"
    return Figures(source, statistic.removesuffix("_ms"),
                   tuple(PrefillPoint(b, s, v[statistic]) for (b, s), v in sorted(found["prefill"].items())),
                   tuple(DecodePoint(b, p, v[statistic]) for (b, p), v in sorted(found["decode"].items())), arch,
                   "GPU" if arch else "CPU machine")


def figures_from_file(path: Path) -> Figures:
    """Figures from JSON: smelter's own shape, or a `benchmarks/gpu_pipeline.py` results file."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise FiguresError(f"{path}: cannot read: {e.strerror or e}") from e
    except ValueError as e:
        raise FiguresError(f"{path}: expected JSON: {e}") from e
    if not isinstance(data, dict):
        raise FiguresError(f"{path}: expected a JSON object, got {type(data).__name__}")
    if isinstance(data.get("decoder"), dict):
        return _gpu_pipeline_figures(path, data)
    return Figures(str(path), _text(path, data, "statistic", "p99"),
                   tuple(PrefillPoint(*_point(path, "prefill", i, p, ("batch", "seq"))) for i, p in
                         enumerate(_list(path, data, "prefill"))),
                   tuple(DecodePoint(*_point(path, "decode", i, p, ("batch", "past"))) for i, p in
                         enumerate(_list(path, data, "decode"))),
                   data.get("arch"))


def _gpu_pipeline_figures(path: Path, data: dict[str, Any]) -> Figures:
    """The decoder engine's figures in a gpu_pipeline results file: p90, the highest quantile it records."""
    try:
        decoder = data["decoder"]
        engine, (batch, seq), past = decoder["engine"], decoder["prefill_shape"], decoder["past"]
        prefill = (PrefillPoint(int(batch), int(seq), float(engine["prefill"]["p90_ms"])),)
        decode = tuple(DecodePoint(int(b), int(past), float(engine[f"decode_b{b}"]["p90_ms"]))
                       for b in decoder["decode_batches"])
    except (KeyError, TypeError, ValueError) as e:
        raise FiguresError(f"{path}: decoder: expected engine.prefill.p90_ms, prefill_shape [batch, seq], past and "
                           f"engine.decode_b<batch>.p90_ms for each of decode_batches ({type(e).__name__}: {e})") from e
    arch = (data.get("gpu") or {}).get("arch")
    return Figures(f"{path} (decoder engine)", "p90", prefill, decode, arch)


def _list(path: Path, data: dict[str, Any], key: str) -> list[Any]:
    value = data.get(key)
    if not isinstance(value, list) or not value:
        raise FiguresError(f"{path}: {key}: expected a non-empty list of points, got {value!r}")
    return value


def _text(path: Path, data: dict[str, Any], key: str, default: str) -> str:
    value = data.get(key, default)
    if not isinstance(value, str):
        raise FiguresError(f"{path}: {key}: expected a string such as 'p99', got {value!r}")
    return value


def _point(path: Path, kind: str, index: int, point: Any, dims: tuple[str, str]) -> tuple[int, int, float]:
    """(dim, dim, ms) of one point; both dims positive integers, ms a positive number."""
    where = f"{path}: {kind}[{index}]"
    if not isinstance(point, dict):
        raise FiguresError(f"{where}: expected an object with {dims[0]}, {dims[1]} and ms, got {point!r}")
    values = []
    for key in dims:
        value = point.get(key)
        least = 0 if key == "past" else 1
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise FiguresError(f"{where}.{key}: expected an integer >= {least}, got {value!r}")
        values.append(value)
    ms = point.get("ms")
    if not isinstance(ms, (int, float)) or isinstance(ms, bool) or not ms > 0 or not math.isfinite(ms):
        raise FiguresError(f"{where}.ms: expected a positive number of milliseconds, got {ms!r}")
    return values[0], values[1], float(ms)
