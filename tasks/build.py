"""Build one engine per (precision, target) from the precision stage's ONNX.

The key covers what the engine depends on beyond its input graph: the target's settings, the
backend and its version, and the machine facts the engine is tied to (CPU ISA, GPU compute
capability), so an engine built on one kind of machine is never reused on another.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from tasks import killpoints
from tasks.backends.base import Backend, BackendUnavailable, Runner, get_backend
from tasks.spec import PipelineSpec, ProfileSpec, TargetSpec
from tasks.store import ArtifactStore, StageResult, stage_key, tool_versions

CACHE_DIR = "_cache"


class BuildUnavailable(BackendUnavailable):
    """This machine cannot build the target (runtime absent, wrong GPU); the message says why."""


def build_key(precision_result: StageResult, target: TargetSpec, backend: Backend,
              profiles: list[ProfileSpec]) -> str:
    """Hash of the precision graph, the target and its profiles, the backend version, this machine."""
    return _build_inputs(precision_result, target, backend, profiles)[0]


def _build_inputs(precision_result: StageResult, target: TargetSpec, backend: Backend,
                  profiles: list[ProfileSpec]) -> tuple[str, dict[str, Any], dict[str, str], dict[str, Any]]:
    """The key and what it hashes (config and tools for the manifest, hardware for the outputs), computed once.

    The target's name is part of it: an engine records the target it was built for, and its
    runner and benchmark read that target's settings back.
    """
    config = {"target": target.model_dump(mode="json"), "profiles": [p.model_dump(mode="json") for p in profiles]}
    tools = {backend.name: backend.version(), **tool_versions("onnx")}
    hardware = backend.hardware(target)
    key = stage_key("build", upstream={"precision": precision_result.key}, config=config, tools=tools,
                    hardware=hardware)
    return key, config, tools, hardware


def run_build(spec: PipelineSpec, precision_result: StageResult, target_name: str, store: ArtifactStore,
              force: bool = False) -> StageResult:
    """The engine for `target_name`; raises BuildUnavailable when this machine cannot build it."""
    target = spec.target(target_name)
    backend = get_backend(target.backend)
    why = backend.missing(target)
    if why:
        raise BuildUnavailable(f"pipeline {spec.name}, target {target.name} ({backend.name}): cannot build "
                               f"here: {why}")
    key, config, tools, hardware = _build_inputs(precision_result, target, backend, list(spec.profiles))
    if not force and (hit := store.lookup(spec.name, "build", key)):
        return hit
    source = backend.source_model(precision_result.path)
    if not source.is_file():
        raise FileNotFoundError(f"precision output {precision_result.path} has no {source.name} to build "
                                f"target {target.name} from")
    cache_dir = store.root / CACHE_DIR / backend.name
    cache_dir.mkdir(parents=True, exist_ok=True)
    with store.writing(spec.name, "build", key, inputs={"precision": precision_result.key}, config=config,
                       tools=tools) as w:
        started = time.perf_counter()
        facts = backend.build(source, target, list(spec.profiles), w.dir, cache_dir)
        build_seconds = time.perf_counter() - started
        killpoints.reach("build")
        if not (w.dir / backend.engine_file).is_file():
            raise RuntimeError(f"backend {backend.name} did not write its engine {backend.engine_file} "
                               f"for target {target.name}")
        w.outputs.update({"backend": backend.name, "backend_version": backend.version(),
                          "engine_file": backend.engine_file, "hardware": hardware})
        w.outputs.update(facts)
        w.outputs.update({"build_seconds": round(build_seconds, 3), "target": target.name,
                          "precision": precision_result.outputs.get("precision"), "source_model": source.name})
    return w.result


def open_engine(spec: PipelineSpec, build_result: StageResult, threads: int | None = None) -> Runner:
    """A runner for a built engine, on the target it was built for (optionally with another thread count)."""
    target = spec.target(build_result.outputs["target"])
    if threads is not None:
        target = target.model_copy(update={"threads": threads})
    return get_backend(build_result.outputs["backend"]).load(Path(build_result.path), target)
