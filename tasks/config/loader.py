"""Reading pipelines.yaml: YAML with line numbers, defaults merged, every problem located.

Every error names the file, the line, the key and what was expected, so a typo in a nightly
config fails in a second instead of after an hour of exports. Every value shown in a message is
cut short: the file may come from anyone. The checks here span several keys of one pipeline (or
several pipelines); those that look at files and the environment are tasks.config.preflight's.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from tasks.backends.table import BACKENDS
from tasks.config import preflight
from tasks.config.schema import (TARGET_CLASSES, Candidate, FleetSpec, PipelineSpec, PipelinesFile, Threshold,
                                 registered_model_name)
from tasks.config.yaml_source import YamlDocument, YamlProblem, clip, key_path, printable, read, shown
from tasks.metrics import HIGHER_IS_BETTER
from tasks.runtime.redact import redacted_url

ENCODER_METRICS = ("cosine_mean", "cosine_min", "max_abs_error")
CLASSIFIER_METRICS = ("label_agreement", "cosine_mean", "cosine_min", "max_abs_error")
DECODER_METRICS = ("top1_agreement", "logit_max_abs_error", "logit_mean_abs_error", "perplexity_delta")
PERFORMANCE_METRICS = ("speedup_vs_reference", "p50_ms", "p90_ms", "p99_ms", "throughput")
MAX_PROBLEMS_SHOWN = 20
MAX_PROBLEM_CHARS = 1000


class SpecError(Exception):
    """An invalid pipelines.yaml; `problems` are full sentences naming file, line and key."""

    def __init__(self, problems: list[str]):
        self.problems = [clip(printable(p), MAX_PROBLEM_CHARS) for p in _bounded(problems)]
        super().__init__("\n".join(self.problems))


Located = tuple[tuple[Any, ...], str]


def _duplicates(key: tuple[str, ...], names: list[Any], what: str = "names") -> list[Located]:
    dupes = sorted({n for n in names if names.count(n) > 1})
    if not dupes:
        return []
    second = next(i for i, n in enumerate(names) if n in dupes and names.index(n) != i)
    return [((*key, second), f"duplicate {what} {dupes}")]


def _semantic_problems(spec: PipelineSpec) -> list[Located]:
    """Checks that span several keys, each reported at the key a user must change."""
    problems = _duplicates(("precisions",), list(spec.precisions))
    problems += _duplicates(("targets",), [t.name for t in spec.targets])
    problems += _duplicates(("benchmark", "batch_sizes"), list(spec.benchmark.batch_sizes), "values")
    problems += _duplicates(("benchmark", "seq_lens"), list(spec.benchmark.seq_lens), "values")
    problems += _gate_problems(spec) + _profile_problems(spec) + _outside_profiles(spec) + _fallback_problems(spec)
    for i, precision in enumerate(spec.precisions):
        reasons = [f"{t.name}: {why}" for t in spec.targets if (why := t.precision_problem(precision))]
        if len(reasons) == len(spec.targets):
            problems.append((("precisions", i), f"no target builds {precision} ({'; '.join(reasons)})"))
    return problems + _gate_point_problems(spec)


def _extension_key(key: Any) -> bool:
    """A top-level `x-...` key: a block of YAML anchors for the pipelines to merge (as Compose files have them)."""
    return isinstance(key, str) and key.startswith("x-")


def _gate_point_problems(spec: PipelineSpec) -> list[Located]:
    """`performance.at` must name a point the benchmark times: a prefill of batch_sizes x seq_lens, or a decoder's
    decode step at one of batch_sizes after benchmark.past_len tokens."""
    at, bench = spec.performance.at, spec.benchmark
    if at is None:
        return []
    where = ("performance", "at")
    if set(at) not in ({"batch", "seq"}, {"batch", "past"}):
        return [(where, "expected {batch: N, seq: N} (a prefill) or, for a decoder, {batch: N, past: N} "
                        "(a decode step)")]
    if "seq" in at:
        if at["batch"] not in bench.batch_sizes or at["seq"] not in bench.seq_lens:
            return [(where, f"{at} is not one of the benchmarked batch_sizes x seq_lens")]
        return []
    if not spec.model.is_decoder:
        return [(where, f"{{batch, past}} names a decode step, and task {spec.model.task} generates no tokens; "
                        "expected {batch: N, seq: N}")]
    if at["batch"] not in bench.batch_sizes:
        return [((*where, "batch"), f"{at['batch']} is not one of benchmark.batch_sizes {bench.batch_sizes}")]
    if at["past"] != bench.past_len:
        return [((*where, "past"), f"{at['past']} is not benchmark.past_len ({bench.past_len}): decode steps are "
                                   f"timed after past_len tokens; set benchmark.past_len: {at['past']}")]
    return []


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
            if metric in (metrics if section == "accuracy" else PERFORMANCE_METRICS):
                problems += _wrong_side(section, metric, threshold)
    return problems


def _wrong_side(section: str, metric: str, threshold: Threshold) -> list[Located]:
    """A bound on the side where engines get better (`max` on cosine, `min` on a latency) fails the better ones."""
    higher = metric in HIGHER_IS_BETTER
    wrong, right = ("max", "min") if higher else ("min", "max")
    if getattr(threshold, wrong) is None:
        return []
    kind = "higher-is-better" if higher else "lower-is-better"
    return [((section, "gates", metric, wrong), f"`{wrong}` on a {kind} metric rejects better engines; "
                                                f"expected `{right}`")]


def _fallback_problems(spec: PipelineSpec) -> list[Located]:
    """int8's accuracy fallback needs a gate it can check on calibration data: refused here, not in the precision
    stage (which asks the same PipelineSpec.fallback_gates)."""
    if spec.quantization.accuracy_fallback is None or not any(c.precision == "int8" for c in spec.candidates()):
        return []
    _, why = spec.fallback_gates()
    return [(("quantization", "accuracy_fallback"), why)] if why else []


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


def _merge(base: Any, override: Any) -> Any:
    if isinstance(base, dict) and isinstance(override, dict):
        return {k: _merge(base.get(k), override[k]) if k in base else override[k] for k in override} | {
            k: v for k, v in base.items() if k not in override}
    return override


class _Report:
    """Problems found in one pipelines file, each rendered `file:line: key: message`."""

    def __init__(self, file: Path, doc: YamlDocument | None):
        self.file, self.doc = file, doc

    def describe(self, loc: tuple[Any, ...], message: str, *, settled: bool = False) -> str:
        """`settled`: the problem is with a value the validated pipeline holds, which, when the file writes it
        neither in the pipeline nor under defaults:, is smelter's own default (the message then says so)."""
        line, found = self.doc.line(loc) if self.doc else (None, False)
        from_defaults = False
        if not found and loc[:1] == ("pipelines",) and len(loc) > 2 and self.doc:
            inherited, from_defaults = self.doc.line(("defaults", *loc[2:]))
            line = inherited if from_defaults else line
        where = f"{self.file}:{line}" if line else str(self.file)
        unwritten = settled and self.doc is not None and not found and not from_defaults and len(loc) > 2
        note = " (not written in the file: smelter's default; set it to change it)" if unwritten else ""
        return _redact_urls(f"{where}: {key_path(list(loc))}: {message}{note}")

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
    problems = [report.describe((k,), "unknown key; expected 'defaults' or 'pipelines' (or 'fleet'; keys starting "
                                      "with 'x-' hold YAML anchors and are not read)")
                for k in top if k not in ("defaults", "pipelines", "fleet") and not _extension_key(k)]
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
        raise SpecError(list(dict.fromkeys(problems)))  # a problem under defaults: is found by every pipeline
    return PipelinesFile(path=file, pipelines=parsed, allow_outside_paths=allow_outside_paths, fleet=fleet,
                         warnings=[clip(printable(w), MAX_PROBLEM_CHARS) for w in _bounded(warnings)])


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
        located = [_pydantic_problem(where, error, merged) for error in e.errors()]
        return [report.describe(_written_at(loc, body, defaults), msg) for loc, msg in located], [], None
    checks = preflight.check(spec, allow_outside_paths=allow_outside_paths, check_env=check_env)
    problems = _semantic_problems(spec) + checks.problems
    return ([report.describe(where + loc, msg, settled=True) for loc, msg in problems],
            [report.describe(where + loc, msg, settled=True) for loc, msg in checks.warnings], spec)


def _written_at(loc: tuple[Any, ...], body: dict, defaults: dict) -> tuple[Any, ...]:
    """Where a pipeline's problem is written: under defaults: when the pipeline only inherits the value, so a
    typo there is reported once, at its own key, instead of once per pipeline."""
    keys = loc[2:]
    return ("defaults", *keys) if keys and not _holds(body, keys) and _holds(defaults, keys) else loc


def _holds(data: Any, keys: tuple[Any, ...]) -> bool:
    """Whether `data`, as the user wrote it, has this key path."""
    for key in keys:
        if isinstance(data, dict) and key in data or isinstance(data, list) and isinstance(key, int) and \
                0 <= key < len(data):
            data = data[key]
        else:
            return False
    return True


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
