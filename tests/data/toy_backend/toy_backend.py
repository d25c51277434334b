"""A smelter backend from outside smelter: the precision stage's ONNX run as written.

It declares itself with its target settings class (the entry point names it) and implements the
Backend and Runner interfaces; onnxruntime is imported only when an engine is built or loaded, so
`smelter validate` reads this module without it. Its promoted engines are packaged for Triton's
onnxruntime platform (`serving`).
"""

from __future__ import annotations

import json
import platform
import shutil
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np
from pydantic import Field

from tasks.backends.base import Backend, BackendUnavailable, EngineMismatch, Runner, TargetSpec
from tasks.config.bounds import MAX_THREADS

SIDECAR = "toy.json"


class ToyTarget(TargetSpec):
    """The CPU, running the precision stage's graph unoptimized."""

    devices: ClassVar = ("cpu",)
    source: ClassVar = "onnx"
    precisions: ClassVar = ("fp32", "int8")
    implementation: ClassVar = "toy_backend:ToyBackend"
    serving: ClassVar = "toy_backend:triton_entry"

    backend: Literal["toy"]
    threads: int | None = Field(None, ge=1, le=MAX_THREADS, description="intra-op threads; None = all cores")

    @property
    def intra_op_threads(self) -> int | None:
        return self.threads

    def with_threads(self, threads: int) -> ToyTarget:
        return self.model_copy(update={"threads": threads})


def triton_entry(repo_dir: Path, model_name: str, engine_dirs: list[Path], benchmark_points: list[dict[str, Any]],
                 slo_ms: float | None, version: int) -> Path:
    """The promoted engine (the first of engine_dirs) as a Triton model served by its onnxruntime platform, which
    reads the inputs and outputs from the graph itself: <repo_dir>/<model_name>/{config.pbtxt, <version>/model.onnx}."""
    model_dir = repo_dir / model_name
    (model_dir / str(version)).mkdir(parents=True, exist_ok=True)
    shutil.copyfile(engine_dirs[0] / "model.onnx", model_dir / str(version) / "model.onnx")
    (model_dir / "config.pbtxt").write_text(f'name: "{model_name}"\nplatform: "onnxruntime_onnx"\nmax_batch_size: 0\n')
    return model_dir


def _session(model: Path, target: ToyTarget) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    if target.threads:
        options.intra_op_num_threads = target.threads
    return ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])


class ToyRunner(Runner):
    def __init__(self, session: Any):
        self.session = session
        self.input_names = [i.name for i in session.get_inputs()]
        self.output_names = [o.name for o in session.get_outputs()]

    def infer(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(zip(self.output_names, self.session.run(self.output_names, feeds)))

    def close(self) -> None:
        self.session = None


class ToyBackend(Backend):
    name = "toy"
    engine_file = "model.onnx"

    def missing(self, target: TargetSpec) -> str | None:
        try:
            import onnxruntime  # noqa: F401
        except ImportError:
            return "onnxruntime is not installed"
        return None

    def version(self) -> str:
        import onnxruntime

        return onnxruntime.__version__

    def hardware(self, target: TargetSpec) -> dict[str, Any]:
        return {"machine": platform.machine()}

    def build(self, onnx_path: Path, target: TargetSpec, profiles: list, out_dir: Path,
              cache_dir: Path) -> dict[str, Any]:
        """The graph itself is the engine: saved whole (weights inline), with the machine it was checked on."""
        import onnx

        if missing := self.missing(target):
            raise BackendUnavailable(missing)
        engine = out_dir / self.engine_file
        onnx.save(onnx.load(str(onnx_path)), str(engine))
        _session(engine, target)  # refuse a graph ONNX Runtime cannot open at build, not at accuracy
        (out_dir / SIDECAR).write_text(json.dumps({"hardware": self.hardware(target)}))
        return {"engine_bytes": engine.stat().st_size}

    def load(self, engine_dir: Path, target: TargetSpec) -> Runner:
        built_on = json.loads((engine_dir / SIDECAR).read_text())["hardware"]
        if built_on != self.hardware(target):
            raise EngineMismatch(f"toy engine {engine_dir} was built on {built_on}, this is {self.hardware(target)}")
        return ToyRunner(_session(engine_dir / self.engine_file, target))
