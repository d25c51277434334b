"""Build one engine per (precision, target): from the precision stage's ONNX, or from the model itself.

The key covers what the engine depends on beyond its source: the target's settings, the backend
and its version, and the machine facts the engine is tied to (CPU ISA, GPU compute capability),
so an engine built on one kind of machine is never reused on another. A backend that declares
`source = "torch"` (Inductor) builds from the HF model, so its candidates have no export,
validate or precision stage.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tasks.backends.base import GRAPHS, Backend, BackendUnavailable, Runner, get_backend
from tasks.backends.table import BACKENDS
from tasks.config.spec import ProfileSpec, TargetSpec
from tasks.config.stage_settings import BuildConfig
from tasks.runtime import killpoints
from tasks.runtime.stage_runner import Work, run_stage
from tasks.runtime.store import ArtifactStore, StageResult, StageWriter, file_digest, tool_versions
from tasks.stages.calibration_feeds import prompt_batches
from tasks.stages.models import model_source_digest

STAGE = "build"
CODE = ("tasks.stages.build",)  # what the stage computes (with the backend's module): part of the key
TORCH_TOOLS = ("torch", "transformers")


class BuildUnavailable(BackendUnavailable):
    """This machine cannot build the target (runtime absent, wrong GPU); the message says why."""


def build_key(precision_result: StageResult, target: TargetSpec, backend: Backend,
              profiles: list[ProfileSpec]) -> str:
    """Hash of the precision graph, the target and its profiles, the backend version, this machine."""
    upstream = {"precision": precision_result.key, "files": precision_result.content}
    parts = _key_parts(target, backend, profiles, upstream, None)
    return Work("", STAGE, parts, _code(target), _nothing).key


def _nothing(*_: Any) -> None:
    """A key alone is wanted: nothing is produced."""


def _key_parts(target: TargetSpec, backend: Backend, profiles: list[ProfileSpec],
               upstream: dict[str, Any], precision: str | None) -> dict[str, Any]:
    """What an engine depends on beyond its source: the target's settings for its precision and profiles,
    the backend and its version, and the machine facts it is tied to (CPU ISA, GPU compute capability)."""
    torch_tools = BACKENDS[target.backend].source == "torch"
    config = {"target": target.key_settings(precision), "profiles": [p.model_dump(mode="json") for p in profiles]}
    return {"upstream": upstream, "config": config,
            "tools": {backend.name: backend.version(), **tool_versions(*(TORCH_TOOLS if torch_tools else ("onnx",)))},
            "hardware": backend.hardware(target)}


def _code(target: TargetSpec, calibrates: bool = False) -> tuple[str, ...]:
    """This stage's code and the backend's (its module and the backend modules it imports), and the
    code that makes calibration feeds where the build calibrates: a fix in any of them rebuilds the
    engines it touches."""
    module = BACKENDS[target.backend].module
    calibration = ("tasks.stages.calibration_feeds", "tasks.stages.inputs", "tasks.stages.models") if calibrates else ()
    return CODE + calibration + tuple(sorted({"tasks.backends.base", module, *backend_imports(module)}))


@functools.cache
def backend_imports(module: str) -> tuple[str, ...]:
    """The `tasks.backends` modules a backend module imports (e.g. TensorRT's plan)."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return ()
    found = set()
    for node in ast.walk(ast.parse(Path(spec.origin).read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and (node.module == "tasks.backends"
                                                 or (node.module or "").startswith("tasks.backends.")):
            found |= {_imported_module(node.module, alias.name) for alias in node.names}
    return tuple(sorted(found))


def _imported_module(package: str, name: str) -> str:
    """The module `from package import name` reads: package.name where that is a module (a backend's
    package importing its own modules), else package itself (name is one of its attributes)."""
    try:
        return f"{package}.{name}" if importlib.util.find_spec(f"{package}.{name}") else package
    except ModuleNotFoundError:  # package is a module, not a package
        return package


def build_work(config: BuildConfig, precision_result: StageResult | None) -> Work:
    """The engine for one (precision, target); raises BuildUnavailable when this machine cannot build it.

    An `onnx` backend builds from the precision stage's graph (`precision_result`); a `torch` one
    from the model's own files, for config.precision (it has no precision stage: None). The target's name
    is part of the key: an engine records the target it was built for, and its runner and benchmark
    read that target's settings back.
    """
    target, precision, model, pipeline = config.target, config.precision, config.source, config.source.pipeline
    backend = get_backend(target.backend)
    if why := backend.missing(target):
        raise BuildUnavailable(f"pipeline {pipeline}, target {target.name} ({backend.name}): cannot build "
                               f"here: {why}")
    from_torch = BACKENDS[target.backend].source == "torch"
    profiles = list(config.profiles)
    if from_torch and model.directory is None:
        raise BuildUnavailable(f"pipeline {pipeline}, target {target.name}: backend {backend.name} builds from the "
                               "model's own files; set model.path to a local copy of the model")
    if from_torch:
        upstream = torch_upstream(config)
    elif precision_result is None:
        raise ValueError(f"pipeline {pipeline}, target {target.name}: backend {backend.name} builds from the "
                         "precision stage's ONNX, and none was given")
    else:
        upstream = {"precision": precision_result.key}
    files = {} if from_torch else {"files": precision_result.content}
    parts = _key_parts(target, backend, profiles, upstream | files, precision)

    def produce(w: StageWriter, _published: StageResult | None) -> None:
        started = time.perf_counter()
        if from_torch:
            source_name = "model"
            calibration = prompt_batches(config.calibration) if config.calibration else None
            facts = backend.build_from_model(model.directory, model.model.task, precision, target, profiles, w.dir,
                                             calibration=calibration)
        else:
            graph = target.source_graph(precision_result.outputs.get("precision"))
            source = precision_result.file(GRAPHS[graph])
            if not source.is_file():
                raise FileNotFoundError(f"precision output {precision_result.path} has no {source.name} (its "
                                        f"{graph} graph) to build target {target.name} from")
            source_name = source.name
            facts = backend.build(source, target, profiles, w.dir, w.cache_dir(backend.name))
        build_seconds = time.perf_counter() - started
        killpoints.reach("build")
        if not (w.dir / backend.engine_file).is_file():
            raise RuntimeError(f"backend {backend.name} did not write its engine {backend.engine_file} "
                               f"for target {target.name}")
        w.outputs.update({"backend": backend.name, "backend_version": backend.version(),
                          "engine_file": backend.engine_file, "hardware": parts["hardware"]})
        w.outputs.update(facts)
        w.outputs.update({"build_seconds": round(build_seconds, 3), "target": target.name,
                          "precision": precision if from_torch else precision_result.outputs.get("precision"),
                          "source_model": source_name})

    return Work(pipeline, STAGE, parts, _code(target, config.calibration is not None), produce, inputs=upstream,
                config=parts["config"], tools=parts["tools"])


def torch_upstream(config: BuildConfig) -> dict[str, Any]:
    """What an engine built from the model itself depends on: the model's files, its task, the precision,
    and, where the build calibrates, the calibration settings and text."""
    upstream: dict[str, Any] = {"model": model_source_digest(config.source), "task": config.source.model.task,
                                "precision": config.precision}
    if config.calibration is not None:
        upstream["calibration"] = {**config.calibration.calibration.model_dump(mode="json"),
                                   "data_sha256": file_digest(config.calibration.data_path)}
    return upstream


def run_build(config: BuildConfig, precision_result: StageResult | None, store: ArtifactStore,
              force: bool = False) -> StageResult:
    """The engine for the config's target, from the precision stage's graph (None: a backend that builds from
    the model); raises BuildUnavailable when this machine cannot build it."""
    return run_stage(build_work(config, precision_result), store, force)


def open_engine(targets: Sequence[TargetSpec], build_result: StageResult, threads: int | None = None) -> Runner:
    """A runner for a built engine, on the target it was built for, found by name among `targets` (the
    pipeline's), optionally with another thread count."""
    target = next(t for t in targets if t.name == build_result.outputs["target"])
    if threads is not None:
        target = target.with_threads(threads)
    return get_backend(build_result.outputs["backend"]).load(Path(build_result.path), target)
