"""ONNX Runtime vs the PyTorch reference, through Polygraphy's Comparator, at every profile shape.

An export that is wrong only at the largest batch or the longest past still ships a broken
engine, so the exported graph is compared with the model it came from on real text at the min,
opt and max point of every profile, output by output, with per-output tolerances. Every row is
real tokens (no padding), so the longest positions are really run, and every feed is checked
against the graph's declared dims first. A failure stops the pipeline before any engine is
built, and leaves no artifact behind.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import numpy as np

from tasks.config.stage_settings import ValidateConfig
from tasks.runtime.error_text import described
from tasks.runtime.stage_runner import Work, run_stage
from tasks.runtime.store import ArtifactStore, StageResult, StageWriter, file_digest, tool_versions
from tasks.stages.inputs import point_feeds, read_texts, reference_outputs
from tasks.stages.models import load_reference, load_tokenizer

if TYPE_CHECKING:
    import torch
    from polygraphy.backend.base import BaseRunner

TOOLS = ("onnxruntime", "polygraphy", "torch", "transformers")
REPORT = "report.json"
ERROR_STAT = "elemwise"
CODE = ("tasks.stages.validate", "tasks.stages.inputs")  # what the stage computes: their source is part of the key


class ValidationFailed(Exception):
    """The exported graph disagrees with PyTorch, or produced NaN/Inf; the message names output and point."""


def torch_reference_runner(model: torch.nn.Module, task: str, inputs: dict[str, dict[str, Any]],
                           name: str = "pytorch-reference") -> BaseRunner:
    """The PyTorch reference as a Polygraphy runner, so the Comparator treats it like any engine.

    Args:
        model: the fp32 reference model in eval mode.
        task: the export task; decides which outputs the model produces.
        inputs: the export's input facts ({name: {"dtype", "shape"}}), which feeds are checked against.
    """
    from polygraphy import util
    from polygraphy.backend.base import BaseRunner
    from polygraphy.common import TensorMetadata

    class TorchReferenceRunner(BaseRunner):
        def __init__(self) -> None:
            super().__init__(name=name, prefix="pytorch-reference")

        @util.check_called_by("get_input_metadata")
        def get_input_metadata_impl(self) -> TensorMetadata:
            meta = TensorMetadata()
            for input_name, facts in inputs.items():
                meta.add(input_name, dtype=np.dtype(facts["dtype"]),
                         shape=[d if isinstance(d, int) else None for d in facts["shape"]])
            return meta

        @util.check_called_by("infer")
        def infer_impl(self, feed_dict: dict[str, np.ndarray]) -> OrderedDict[str, np.ndarray]:
            start = time.time()
            outputs = reference_outputs(model, dict(feed_dict), task)
            self.inference_time = time.time() - start
            return OrderedDict(outputs)

    return TorchReferenceRunner()


def validate_key(config: ValidateConfig, export_result: StageResult) -> str:
    return validate_work(config, export_result).key


def validate_work(config: ValidateConfig, export_result: StageResult) -> Work:
    """The export compared with PyTorch; producing raises ValidationFailed (publishing nothing) when they disagree."""
    settings, tools = _settings(config), tool_versions(*TOOLS)
    pipeline = config.source.pipeline

    def produce(w: StageWriter, _published: StageResult | None) -> None:
        report = compare(config, export_result)
        if not report["passed"]:
            raise ValidationFailed(f"pipeline {pipeline}: the ONNX export {export_result.key} does not match "
                                   "PyTorch:\n  " + "\n  ".join(report["failures"]))
        (w.dir / REPORT).write_text(json.dumps(report, indent=2))
        w.outputs.update({name: report[name] for name in ("passed", "points", "outputs", "nan_inf")})

    parts = {"upstream": [export_result.key, export_result.content], "config": settings, "tools": tools}
    return Work(pipeline, "validate", parts, CODE, produce, inputs={"export": export_result.key}, config=settings,
                tools=tools)


def _settings(config: ValidateConfig) -> dict[str, Any]:
    return {"validation": config.validation, "profiles": list(config.profiles), "error_stat": ERROR_STAT,
            "data": {"path": config.data, "sha256": file_digest(config.data_path)}}


def _shape_points(config: ValidateConfig) -> dict[str, dict[str, int]]:
    """min/opt/max of every profile (named profile<i>.<point> when there are several).

    Decoders with a KV cache also get a `prefill` point (empty past, longest seq): a profile may
    start at past >= 1, yet the first step of every generation runs with no past at all.
    """
    profiles = config.profiles
    single = len(profiles) == 1
    points = {(point if single else f"profile{i}.{point}"): shape
              for i, profile in enumerate(profiles) for point, shape in profile.shapes().items()}
    if config.source.model.has_past:
        first = profiles[0]
        points["prefill"] = {"batch": first.batch[1], "seq": first.seq[2], "past": 0}
    return points


def _nan_inf(run_results: Any, points: list[str]) -> list[str]:
    """Which runner/output/point produced NaN or Inf (Polygraphy's validate only says whether any did)."""
    found = []
    for runner_name, iterations in run_results:
        for point, iteration in zip(points, iterations):
            for output, value in iteration.items():
                if not np.all(np.isfinite(value)):
                    found.append(f"{output} at {point} ({runner_name}): NaN or Inf")
    return found


def _reference_output(name: str, _index: int, reference: Any) -> list[str]:
    """Compare only what PyTorch produces (an export may add outputs the reference has no name for)."""
    return [name] if name in reference else []


def output_stats(result: Any) -> dict[str, Any]:
    """One output's errors from a Polygraphy compare result; a shape mismatch (a bare False) is a failure, not a crash."""
    from polygraphy.comparator.compare import OutputCompareResult

    if not isinstance(result, OutputCompareResult):
        return {"max_abs": None, "mean_abs": None, "median_abs": None, "max_rel": None, "passed": False,
                "problem": "shape mismatch"}
    return {"max_abs": result.max_absdiff, "mean_abs": result.mean_absdiff, "median_abs": result.median_absdiff,
            "max_rel": result.max_reldiff, "passed": bool(result)}


def _describe_failure(output: str, point: str, shape: dict[str, int], stats: dict[str, Any]) -> str:
    where = f"output {output!r} at {point} shape {shape}"
    if stats["max_abs"] is None:
        return f"{where}: {stats['problem']}"
    return (f"{where}: max_abs {stats['max_abs']:.3g}, mean_abs {stats['mean_abs']:.3g}, "
            f"max_rel {stats['max_rel']:.3g} exceed atol {stats['atol']:g} / rtol {stats['rtol']:g}")


def _static(dim: int | str) -> bool:
    """A fixed dim; the export's facts write an unnamed open dim as 0, which is no size a graph fixes."""
    return isinstance(dim, int) and dim > 0


def feed_shape_problems(feeds: dict[str, np.ndarray], declared: dict[str, list[int | str]], point: str) -> list[str]:
    """Where a feed's shape disagrees with the graph's declared input dims (a fixed dim must match exactly;
    a named dim must take one value across the inputs that share it).

    Polygraphy's Comparator reshapes a feed that does not fit (a zero-size one fits any zero-size
    shape), which would compare the engine on inputs it was never given; so they are checked first.
    """
    problems, bound = [], {}
    for name, value in feeds.items():
        dims = declared.get(name)
        if dims is None:
            continue
        where = f"input {name!r} at {point}: fed shape {list(value.shape)}, the graph declares {list(dims)}"
        if len(dims) != value.ndim:
            problems.append(f"{where} (rank {value.ndim} vs {len(dims)})")
            continue
        for axis, (dim, size) in enumerate(zip(dims, value.shape)):
            if _static(dim) and dim != size:
                problems.append(f"{where} (axis {axis} must be {dim})")
            elif isinstance(dim, str) and dim:
                first = bound.setdefault(dim, (size, name))
                if first[0] != size:
                    problems.append(f"{where} (axis {axis} {dim!r} is {size}, but {first[0]} in {first[1]!r})")
    return problems


def _point_feeds(config: ValidateConfig, declared: dict[str, list[int | str]], points: dict[str, dict[str, int]],
                 tokenizer: Any, reference: torch.nn.Module) -> list[dict[str, np.ndarray]]:
    """Real-token feeds at every point: encoder rows are filled with text, never padded, so the longest
    positions are run; an empty KV cache is shaped as the graph declares it."""
    texts = read_texts(config.data_path)
    return [point_feeds(config.source.model, tokenizer, reference, texts, shape, list(declared), declared,
                        real_tokens_only=True) for shape in points.values()]


def _runner_failure(runners: list[BaseRunner], points: dict[str, dict[str, int]], feeds: list[dict[str, np.ndarray]],
                    error: Exception) -> str:
    """Which runner failed at which point: the Comparator runs every point in one go, so rerun them one by one."""
    from polygraphy.comparator import Comparator

    for (point, shape), feed in zip(points.items(), feeds):
        for runner in runners:
            try:
                Comparator.run([runner], data_loader=[feed])
            except Exception as e:
                return f"{runner.name} failed at {point} shape {shape}: {described(e)}"
    return f"a runner failed: {described(error)}"


def _failed_report(points: dict[str, dict[str, int]], failures: list[str]) -> dict[str, Any]:
    return {"passed": False, "points": points, "outputs": {}, "nan_inf": [], "failures": failures}


def compare(config: ValidateConfig, export_result: StageResult) -> dict[str, Any]:
    """Run ONNX Runtime and PyTorch on the same real inputs at every shape point; the report, pass or fail."""
    from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx
    from polygraphy.comparator import Comparator, SimpleCompareFunc
    from polygraphy.logger import G_LOGGER

    inputs = export_result.outputs["inputs"]
    model, validation = config.source.model, config.validation
    reference = load_reference(config.source)
    points = _shape_points(config)
    declared = {name: facts["shape"] for name, facts in inputs.items()}
    feeds = _point_feeds(config, declared, points, load_tokenizer(config.source), reference)
    mismatched = [problem for point, feed in zip(points, feeds)
                  for problem in feed_shape_problems(feed, declared, point)]
    if mismatched:
        return _failed_report(points, mismatched)
    onnx_runner = OnnxrtRunner(SessionFromOnnx(str(export_result.file("model.onnx")), providers=["cpu"]),
                               name="onnxruntime")
    torch_runner = torch_reference_runner(reference, model.task, inputs)
    with G_LOGGER.verbosity(G_LOGGER.ERROR):
        try:
            run_results = Comparator.run([onnx_runner, torch_runner], data_loader=feeds)
        except Exception as e:  # a graph (or reference) that cannot run a point's real tokens fails validation
            return _failed_report(points, [_runner_failure([onnx_runner, torch_runner], points, feeds, e)])
        finite = Comparator.validate(run_results, check_nan=True, check_inf=True)
        tolerances = {name: validation.tolerance(name) for name in run_results[torch_runner.name][0]}
        compare_func = SimpleCompareFunc(
            atol={"": validation.atol, **{name: t.atol for name, t in tolerances.items()}},
            rtol={"": validation.rtol, **{name: t.rtol for name, t in tolerances.items()}},
            check_error_stat=ERROR_STAT, find_output_func=_reference_output)
        accuracy = Comparator.compare_accuracy(run_results, compare_func=compare_func)
    per_point = accuracy[0][(onnx_runner.name, torch_runner.name)]
    outputs: dict[str, dict[str, Any]] = {}
    for point, matches in zip(points, per_point):
        for output, result in matches.items():
            tol = tolerances[output]
            outputs.setdefault(output, {})[point] = output_stats(result) | {"atol": tol.atol, "rtol": tol.rtol}
    nan_inf = [] if finite else _nan_inf(run_results, list(points))
    failures = [_describe_failure(output, point, points[point], stats)
                for output, by_point in sorted(outputs.items()) for point, stats in by_point.items()
                if not stats["passed"]]
    return {"passed": not failures and not nan_inf, "points": points, "outputs": outputs, "nan_inf": nan_inf,
            "failures": nan_inf + failures}


def run_validate(config: ValidateConfig, export_result: StageResult, store: ArtifactStore,
                 force: bool = False) -> StageResult:
    """Compare the export with PyTorch; raise ValidationFailed (writing nothing) when it disagrees."""
    return run_stage(validate_work(config, export_result), store, force)
