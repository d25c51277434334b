"""The one small interface every engine backend implements: build an engine, load a runner.

Follows Polygraphy's split between loaders (build) and runners (infer); the stages only ever see
this interface, so a TensorRT target and a CPU target go through the same build, accuracy and
benchmark code.
"""

from __future__ import annotations

import abc
import importlib
import time
from pathlib import Path
from typing import Any

import numpy as np

from tasks.backends.table import BACKENDS
from tasks.spec import ProfileSpec, TargetSpec


class BackendUnavailable(RuntimeError):
    """The backend's runtime is not installed or this machine cannot run the target."""


class Runner(abc.ABC):
    """A loaded engine. Feeds and outputs are keyed by the ONNX tensor names."""

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
        """Release sessions, contexts and device memory."""

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Backend(abc.ABC):
    """Builds engines for one kind of target and loads them back as runners."""

    name: str
    engine_file: str

    @abc.abstractmethod
    def missing(self, target: TargetSpec) -> str | None:
        """Why this machine cannot build or run `target` (package absent, wrong GPU), or None."""

    @abc.abstractmethod
    def version(self) -> str:
        """The runtime version; part of the build key."""

    @abc.abstractmethod
    def hardware(self, target: TargetSpec) -> dict[str, Any]:
        """Facts about this machine that an engine is tied to (CPU ISA, compute capability); part of the key."""

    @abc.abstractmethod
    def source_model(self, precision_dir: Path) -> Path:
        """Which of the precision stage's ONNX files this backend builds from."""

    @abc.abstractmethod
    def build(self, onnx_path: Path, target: TargetSpec, profiles: list[ProfileSpec], out_dir: Path,
              cache_dir: Path) -> dict[str, Any]:
        """Write the engine (and its sidecar files) into out_dir; return facts for the manifest.

        The facts include `engine_bytes`: the engine's own size, without sidecars or caches.
        """

    @abc.abstractmethod
    def load(self, engine_dir: Path, target: TargetSpec) -> Runner:
        """Open a built engine for inference, refusing one built for another machine."""


def get_backend(name: str) -> Backend:
    """The backend for a target's `backend:` key, from the backend table.

    Imported on first use, so a runtime that is absent (or a backend module not installed) only
    fails the targets that name it, with BackendUnavailable saying why.
    """
    info = BACKENDS.get(name)
    if info is None:
        raise ValueError(f"unknown backend {name!r}; expected one of {', '.join(BACKENDS)}")
    try:
        backend_class = getattr(importlib.import_module(info.module), info.class_name)
    except (ImportError, AttributeError) as e:
        raise BackendUnavailable(f"backend {name} is not available here: cannot import {info.module}."
                                 f"{info.class_name} ({e})") from e
    return backend_class()
