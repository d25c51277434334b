"""Each built-in backend is a package of its own (tasks/backends/<name>/), and an engine's build key still
covers the backend's code there: a fix in a module its backend imports from its own package (Inductor's
graph weights, TensorRT's build plan) rebuilds its engines."""

from __future__ import annotations

import pytest

from tasks.backends.base import TargetSpec
from tasks.config.spec import BACKENDS
from tasks.stages.build import _code


@pytest.mark.parametrize(("backend", "settings", "helpers"), [
    ("inductor", {"arch": "sm90"}, ["graph_weights", "kernel_bundle", "llama_graphs", "precompiled", "program_load"]),
    ("tensorrt", {"arch": "sm90"}, ["plan"]),
])
def test_a_build_key_covers_the_modules_of_its_backend_package(backend: str, settings: dict,
                                                               helpers: list[str]) -> None:
    target: TargetSpec = BACKENDS[backend].target(name="t", backend=backend, **settings)
    code = _code(target)
    assert f"tasks.backends.{backend}.backend" in code
    assert "tasks.backends.base" in code
    assert {f"tasks.backends.{backend}.{name}" for name in helpers} <= set(code)


def test_every_built_in_backend_is_registered_from_its_own_package() -> None:
    for name in ("onnxruntime", "tensorrt", "inductor"):
        assert BACKENDS[name].target.__module__ == f"tasks.backends.{name}.target"
        assert BACKENDS[name].module == f"tasks.backends.{name}.backend"
