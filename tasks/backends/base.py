"""The interface every engine backend implements: its target settings, its builder and its runner.

A backend is a plugin (tasks/backends/table.py finds it through the `smelter.backends` entry
points). It declares itself with a `TargetSpec` subclass: the settings a target of it takes, and,
as class variables, its device kind, what it builds from, its precisions and where its `Backend`
lives. The core calls only what is declared here, so a new backend needs no edit outside its own
package. Follows Polygraphy's split between loaders (build) and runners (infer).
"""

from __future__ import annotations

import abc
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np
from pydantic import Field

from tasks.backends.table import BACKENDS, load_implementation
from tasks.config.bounds import NAME, Strict

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from tasks.config.profiles import ProfileSpec


GRAPHS = {"neutral": "model.onnx", "cpu": "model.cpu.onnx"}
"""The graphs the precision stage writes, by name, with their file: `neutral` for every precision (fp32 as
exported, fp16 with Cast nodes, int8 with Q/DQ nodes in TensorRT's dialect: symmetric S8, per-channel weights),
`cpu` for int8 alone (ONNX Runtime's own fusions, then quantized the way its x86 kernels are fast). It writes
only those that the pipeline's targets build from."""


class BackendUnavailable(RuntimeError):
    """The backend's runtime is not installed or this machine cannot run the target."""


class EngineMismatch(RuntimeError):
    """An engine was built for another GPU, runtime or format; loading it would fail or be wrong.

    Permanent for that engine on this machine, so a champion that raises it may lose its alias.
    """


class TargetSpec(Strict):
    """Where an engine runs: one subclass per backend, the pydantic union on `backend` of the schema.

    A subclass declares its backend: the `backend` field (a Literal of its name) and the class
    variables below. A setting of another backend is then an error, and a build key hashes only
    the target's own settings.
    """

    devices: ClassVar[tuple[Literal["cpu", "gpu"], ...]]
    """The kinds of device its engines run on; the first is the default `device_kind`."""
    source: ClassVar[Literal["onnx", "torch"]]
    """What it builds from: the precision stage's ONNX graph, or the PyTorch model itself."""
    precisions: ClassVar[tuple[str, ...]]
    """The precisions it can build, a subset of tasks.config.bounds.PRECISIONS."""
    implementation: ClassVar[str]
    """`module:Class` of its `Backend`, imported on first use (settings load without the runtime)."""
    graphs: ClassVar[dict[str, str]] = {}
    """An `onnx` source's graph (a name of GRAPHS) for each precision it does not build from `neutral`,
    e.g. {"int8": "cpu"}."""
    serving: ClassVar[str | None] = None
    """`module:function` that lays its promoted engines out as a serving package (TensorRT's: a Triton model
    repository entry), imported on use; None: its engines are not packaged. tasks/judge/serving.py calls it as
    `function(out_dir, model_name, engine_dirs, benchmark_points, slo_ms, version) -> the package's directory`."""
    precision_settings: ClassVar[dict[str, tuple[str, ...]]] = {}
    """Settings only one precision's builds read: left out of other precisions' keys, and idle when
    that precision is not built."""

    name: str = Field(max_length=64, pattern=NAME)
    backend: str
    pool: str | None = Field(None, max_length=64, pattern=NAME, exclude=True,
                             description="Prefect work pool that builds it (default cpu, or gpu-<arch>); "
                                         "where an engine is built is not part of its key")

    @property
    def device_kind(self) -> str:
        """`cpu` or `gpu`: where this target's engines run."""
        return self.devices[0]

    @property
    def gpu_arch(self) -> str | None:
        """The GPU arch its engines are tied to (registry tags and descriptions name it); None off the GPU."""
        return None

    @property
    def intra_op_threads(self) -> int | None:
        """The threads its engines run with when the benchmark sets none; None = all cores."""
        return None

    def with_threads(self, threads: int) -> TargetSpec:
        """This target running its engines on `threads` (the benchmark's count); targets without threads ignore it."""
        return self

    def key_settings(self, precision: str | None) -> dict[str, Any]:
        """The settings an engine of `precision` depends on (what its build key hashes)."""
        other = {key for p, keys in self.precision_settings.items() if p != precision for key in keys}
        return self.model_dump(mode="json", exclude=other or None)

    def source_graph(self, precision: str) -> str:
        """The precision stage's graph (a name of GRAPHS) this target's engine of `precision` builds from."""
        return self.graphs.get(precision, "neutral")

    def calibrates(self, precision: str) -> bool:
        """Whether this target's build of `precision` reads the calibration text itself (the int8 ONNX
        graphs are calibrated by the precision stage instead)."""
        return False

    def precision_problem(self, precision: str) -> str | None:
        """Why this target cannot build `precision`, or None."""
        if precision not in self.precisions:
            return f"backend {self.backend} does not build {precision} (it builds {', '.join(self.precisions)})"
        return None

    def model_problems(self, precision: str, config: Mapping[str, Any],
                       decoder: bool) -> list[tuple[tuple[Any, ...], str]]:
        """Why this target cannot build `precision` of the model whose config.json is `config` (`decoder`: its
        task generates text), each as (where, why): `where` a key path inside this target, e.g.
        ("fp8_exclude", 0), or () for the precision itself. `smelter validate` asks each target of the
        precisions it builds, before any work: a rule that holds for some models only is its backend's own
        (Inductor builds fp8 for Llama-family decoders and BERT-family encoders alone), never another backend's."""
        return []


class Runner(abc.ABC):
    """A loaded engine. Feeds and outputs are keyed by the ONNX tensor names.

    `input_names` and `output_names` are its input metadata: the accuracy and benchmark stages
    make feeds for exactly these inputs.
    """

    input_names: list[str]
    output_names: list[str]

    @abc.abstractmethod
    def infer(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run once and return host arrays."""

    def time_ms(self, feeds: dict[str, np.ndarray], warmup: int, repeats: int) -> list[float]:
        """Raw per-call latencies; GPU backends override this with device-event timing."""
        for _ in range(warmup):
            self.infer(feeds)
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            self.infer(feeds)
            samples.append((time.perf_counter() - start) * 1e3)
        return samples

    def close(self) -> None:
        """Unload: release sessions, contexts and device memory."""

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Backend(abc.ABC):
    """Builds engines for one kind of target and loads them back as runners.

    An `onnx`-source backend implements `build` (from the graph its target names in `source_graph`);
    a `torch`-source one implements `build_from_model`.
    """

    name: str
    engine_file: str
    compares_three_way: ClassVar[bool] = False
    """Whether accuracy records FP32 ONNX vs the precision graph its engine was built from vs the engine (an
    `onnx` source only), to say whether an error comes from the graph or from the builder."""

    @abc.abstractmethod
    def missing(self, target: TargetSpec) -> str | None:
        """Why this machine cannot build or run `target` (package absent, wrong GPU), or None."""

    @abc.abstractmethod
    def version(self) -> str:
        """The runtime version; part of the build key."""

    @abc.abstractmethod
    def hardware(self, target: TargetSpec) -> dict[str, Any]:
        """Facts about this machine that an engine is tied to (CPU ISA, compute capability); part of the key."""

    def int8_products(self, target: TargetSpec) -> str:
        """How the processor running `target`'s engines adds int8 products: `exact` (in 32 bits) or `saturating`
        (pairs summed into 16 bits, as x86 without VNNI does). Asked by the precision stage for the int8 `cpu`
        graph this backend builds from: for a saturating processor it quantizes that graph with 7-bit weights."""
        return "exact"

    def build(self, onnx_path: Path, target: TargetSpec, profiles: list[ProfileSpec], out_dir: Path,
              cache_dir: Path) -> dict[str, Any]:
        """Write the engine (and its sidecar files) into out_dir; return facts for the manifest.

        The facts include `engine_bytes`: the engine's own size, without sidecars or caches.
        """
        raise TypeError(f"backend {self.name} builds from the model's own files (source 'torch'), not from "
                        f"{onnx_path.name}: call build_from_model")

    def build_from_model(self, model_dir: Path, task: str, precision: str, target: TargetSpec,
                         profiles: list[ProfileSpec], out_dir: Path,
                         calibration: Sequence[Mapping[str, np.ndarray]] | None = None) -> dict[str, Any]:
        """Like `build`, from the model's own files, for `precision`; `calibration` are whole-prompt
        feeds where `target.calibrates(precision)`."""
        raise TypeError(f"backend {self.name} builds from the precision stage's ONNX (source 'onnx'), not from "
                        f"{model_dir}: call build")

    @abc.abstractmethod
    def load(self, engine_dir: Path, target: TargetSpec) -> Runner:
        """Open a built engine for inference, refusing one built for another machine (EngineMismatch)."""


def get_backend(name: str) -> Backend:
    """The backend for a target's `backend:` key.

    Imported on first use, so a runtime that is absent only fails the targets that name it, with
    BackendUnavailable saying why.
    """
    info = BACKENDS.get(name)
    if info is None:
        raise ValueError(f"unknown backend {name!r}; expected one of {', '.join(BACKENDS)}")
    try:
        backend_class = load_implementation(info)
    except (ImportError, AttributeError) as e:
        raise BackendUnavailable(f"backend {name} is not available here: cannot import {info.implementation} "
                                 f"({e})") from e
    return backend_class()
