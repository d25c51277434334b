"""Every TensorRT name tasks/backends/tensorrt/backend.py uses exists in the real 10.x and 11.x Python bindings.

TensorRT cannot be installed here, so the name lists in tests/data/tensorrt_api_{10,11}.json come
from the real tensorrt-cu12-bindings wheels (scripts/trt_api_names.py says how). The scan follows
TensorRT objects through assignments (`builder = trt.Builder(...)`, `config = builder.create_builder_config()`,
`self._engine = runtime.deserialize_cuda_engine(...)`, parameters and functions annotated `trt.X`) using the return
types recorded from the bindings' signatures, and checks each attribute used on them.

The name lists cover the oldest 10.x we support (10.8, the pinned docker image's) and the newest
10.x and 11.x. A version gate is `if _since(N):` or `if _since(N, M):` (body: TensorRT N.M and
later; else: earlier), its negation, or the same test in a conditional expression. A name one
version lacks must sit under a gate that excludes it.
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MODULE = ROOT / "tasks" / "backends" / "tensorrt" / "backend.py"
def _release(data: dict) -> tuple[int, int]:
    major, minor = data["tensorrt_version"].split(".")[:2]
    return int(major), int(minor)


API = {_release(d): d for d in (json.loads(p.read_text()) for p in sorted((ROOT / "tests" / "data").glob("tensorrt_api_*.json")))}
VERSIONS = tuple(sorted(API))


def newest(major: int) -> dict:
    return API[max(v for v in VERSIONS if v[0] == major)]
MODULE_TYPE = "<module tensorrt>"


@dataclass(frozen=True)
class Use:
    line: int
    owner: str
    name: str
    majors: frozenset[int]

    @property
    def qualified(self) -> str:
        return f"trt.{self.name}" if self.owner == MODULE_TYPE else f"{self.owner}.{self.name}"


def _returns(key: str) -> str | None:
    return next((API[v]["returns"][key] for v in reversed(VERSIONS) if key in API[v]["returns"]), None)


def _is_class(path: str) -> bool:
    return any(path in API[v]["classes"] for v in VERSIONS)


class _Types:
    """What each variable holds: the tensorrt module, a TensorRT class, or an instance of one.

    Local names are scoped to their function and seen by functions nested in it; `self.x` attributes
    are shared by the whole module.
    """

    def __init__(self, tree: ast.AST):
        self.scope: dict[ast.AST, str] = {}
        _assign_scopes(tree, "", self.scope)
        self.function_returns = {node.name: _dotted(node.returns, "trt") for node in ast.walk(tree)
                                 if isinstance(node, ast.FunctionDef) and node.returns is not None
                                 and _dotted(node.returns, "trt")}
        self.env: dict[tuple[str, str], tuple[str, str]] = {}
        self.conflicts: list[str] = []
        changed = True
        while changed:
            changed = False
            for node in ast.walk(tree):
                for key, kind in self._bindings(node):
                    if kind is None:
                        continue
                    if key not in self.env:
                        self.env[key], changed = kind, True
                    elif self.env[key] != kind and key[1] not in self.conflicts:
                        self.conflicts.append(key[1])

    def _bindings(self, node: ast.AST):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and (name := _key(node.targets[0])):
            yield self._scoped(node, name), self.of(node.value)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for arg in node.args.args + node.args.kwonlyargs:
                if arg.annotation is not None and (kind := self.of(arg.annotation, annotation=True)):
                    yield (self.scope[arg.annotation], arg.arg), ("instance", kind[1])

    def _scoped(self, node: ast.AST, name: str) -> tuple[str, str]:
        return ("<self>", name) if name.startswith("self.") else (self.scope[node], name)

    def of(self, node: ast.expr, annotation: bool = False) -> tuple[str, str] | None:
        if annotation and isinstance(node, ast.Attribute) and _dotted(node, "trt"):
            path = _dotted(node, "trt")
            return ("class", path) if _is_class(path) else None
        if isinstance(node, ast.Call):
            if isinstance(node.func, ast.Name) and node.func.id == "_trt":
                return ("module", MODULE_TYPE)
            if isinstance(node.func, ast.Name) and node.func.id in self.function_returns:
                return ("instance", self.function_returns[node.func.id])
            called = self.of(node.func)
            if called and called[0] in ("class", "method"):
                return ("instance", called[1])
            return None
        if isinstance(node, ast.Attribute) and (name := _key(node)):
            return self.env.get(self._scoped(node, name))
        if isinstance(node, ast.Attribute):
            owner = self.of(node.value)
            if owner is None:
                return None
            kind, path = owner
            if kind == "module":
                if _is_class(node.attr):
                    return ("class", node.attr)
                target = _returns(node.attr)
                return ("method", target) if target and _is_method(MODULE_TYPE, node.attr) else None
            if kind == "class" and _is_class(f"{path}.{node.attr}"):
                return ("class", f"{path}.{node.attr}")
            target = _returns(f"{path}.{node.attr}")
            if target is None:
                return None
            if kind == "class":
                return ("instance", target)
            return ("method", target) if _is_method(path, node.attr) else ("instance", target)
        name = _key(node)
        if name is None:
            return None
        scope, _ = self._scoped(node, name)
        while True:
            if (scope, name) in self.env:
                return self.env[(scope, name)]
            if not scope or scope == "<self>":
                return None
            scope = scope.rpartition(".")[0]


def _assign_scopes(node: ast.AST, scope: str, out: dict[ast.AST, str]) -> None:
    for child in ast.iter_child_nodes(node):
        inner = f"{scope}.{child.name}" if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else scope
        out[child] = inner if child is not node else scope
        _assign_scopes(child, inner, out)


def _is_method(owner: str, member: str) -> bool:
    """Properties and enum values read as instances; methods need a call."""
    key = member if owner == MODULE_TYPE else f"{owner}.{member}"
    return any(key in API[v]["methods"] for v in VERSIONS)


def _key(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return f"self.{node.attr}"
    return None


def _dotted(node: ast.expr, root: str) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join(reversed(parts)) if isinstance(node, ast.Name) and node.id == root else None


def _gate(test: ast.expr) -> tuple[tuple[int, int], bool] | None:
    """((N, M), True) for `_since(N, M)` (M = 0 when left out), ((N, M), False) for its negation."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not) and (inner := _gate(test.operand)):
        return inner[0], not inner[1]
    if (isinstance(test, ast.Call) and isinstance(test.func, ast.Name) and test.func.id == "_since"
            and 1 <= len(test.args) <= 2 and all(isinstance(a, ast.Constant) for a in test.args)):
        values = [int(a.value) for a in test.args]
        return (values[0], values[1] if len(values) == 2 else 0), True
    return None


def collect_uses(source: str) -> tuple[list[Use], list[str]]:
    """Every TensorRT attribute the source reads, with the versions its gates let it run on."""
    tree = ast.parse(source)
    types = _Types(tree)
    uses: list[Use] = []

    def visit(node: ast.AST, majors: frozenset[tuple[int, int]]) -> None:
        if isinstance(node, (ast.If, ast.IfExp)) and (gate := _gate(node.test)):
            release, since = gate
            newer = frozenset(m for m in majors if m >= release)
            older = majors - newer
            visit(node.test, majors)
            body = node.body if isinstance(node.body, list) else [node.body]
            orelse = node.orelse if isinstance(node.orelse, list) else [node.orelse]
            for child in body:
                visit(child, newer if since else older)
            for child in orelse:
                visit(child, older if since else newer)
            return
        if isinstance(node, ast.Attribute) and (owner := types.of(node.value)) and owner[0] != "method":
            uses.append(Use(node.lineno, owner[1], node.attr, majors))
        for child in ast.iter_child_nodes(node):
            visit(child, majors)

    visit(tree, frozenset(VERSIONS))
    return uses, types.conflicts


def problems(uses: list[Use]) -> list[str]:
    """Names missing from a version the use can run on; dunders (__version__, __init__) are Python's own."""
    found = []
    for use in uses:
        if use.name.startswith("__") and use.name.endswith("__"):
            continue
        for major in sorted(use.majors):
            api = API[major]
            names = api["module"] if use.owner == MODULE_TYPE else api["classes"].get(use.owner, [])
            if use.name not in names:
                found.append(f"line {use.line}: {use.qualified} does not exist in TensorRT {api['tensorrt_version']}; "
                             f"put it under `if _since(N, M):` so it only runs where it exists")
    return found


def test_backend_uses_only_names_both_majors_have_or_gates_them():
    uses, conflicts = collect_uses(MODULE.read_text())
    assert not conflicts, f"these names hold different TensorRT types in {MODULE.name}, so the scan cannot check them: {conflicts}"
    assert problems(uses) == []


def test_scan_sees_the_build_and_runtime_api():
    """The scan must follow objects through the module; if it went blind, the test above would pass vacuously."""
    checked = {use.qualified for use in collect_uses(MODULE.read_text())[0]}
    expected = {"Builder.create_network", "Builder.build_serialized_network", "OnnxParser.get_error",
                "ParserError.desc", "IBuilderConfig.set_memory_pool_limit", "IBuilderConfig.builder_optimization_level",
                "IBuilderConfig.hardware_compatibility_level", "IBuilderConfig.set_timing_cache",
                "IOptimizationProfile.set_shape", "ICudaEngine.num_io_tensors", "ICudaEngine.create_engine_inspector",
                "IExecutionContext.set_input_shape", "IExecutionContext.set_tensor_address",
                "IExecutionContext.execute_async_v3", "trt.NetworkDefinitionCreationFlag", "BuilderFlag.VERSION_COMPATIBLE",
                "Runtime.engine_host_code_allowed", "ILogger.Severity.ERROR", "IBuilderConfig.get_timing_cache",
                "ITimingCache.combine", "IExecutionContext.set_output_allocator", "trt.IOutputAllocator",
                "HardwareCompatibilityLevel.SAME_COMPUTE_CAPABILITY"}
    assert expected - checked == set()


UNGATED_FP16 = """
def build():
    trt = _trt()
    builder = trt.Builder(None)
    config = builder.create_builder_config()
    config.set_flag(trt.BuilderFlag.FP16)
"""


def test_check_flags_a_name_removed_in_11():
    found = problems(collect_uses(UNGATED_FP16)[0])
    assert len(found) == 1
    assert "BuilderFlag.FP16 does not exist in TensorRT 11." in found[0]


def test_check_accepts_that_name_under_a_version_gate():
    gated = UNGATED_FP16.replace("    config.set_flag(trt.BuilderFlag.FP16)",
                                 "    if _since(11):\n        pass\n    else:\n        config.set_flag(trt.BuilderFlag.FP16)")
    assert problems(collect_uses(gated)[0]) == []


@pytest.mark.parametrize("snippet, missing_in", [
    ("def f(engine: trt.ICudaEngine):\n    return engine.num_bindings\n", {10, 11}),
    ("def f():\n    trt = _trt()\n    return trt.Runtime(None).deserialize_cuda_engine(b'').num_bindings\n", {10, 11}),
    ("def f():\n    trt = _trt()\n    return 1 if _since(11) else trt.BuilderFlag.INT8\n", set()),
    ("def f():\n    trt = _trt()\n    return trt.BuilderFlag.INT8 if not _since(11) else 1\n", set()),
])
def test_check_follows_types_and_gates(snippet, missing_in):
    found = problems(collect_uses(snippet)[0])
    assert {int(p.split("TensorRT ")[1].split(".")[0]) for p in found} == missing_in


def test_name_lists_come_from_both_majors_and_the_pinned_10_8():
    assert VERSIONS[0] == (10, 8) and newest(10)["tensorrt_version"].startswith("10.") and 11 in {v[0] for v in VERSIONS}
    assert "FP16" in newest(10)["classes"]["BuilderFlag"] and "FP16" not in newest(11)["classes"]["BuilderFlag"]
    assert "execute_async_v3" in newest(11)["classes"]["IExecutionContext"]


def test_a_name_added_in_a_minor_release_needs_a_minor_gate():
    """SAME_COMPUTE_CAPABILITY came in TensorRT 10.9; the pinned image's 10.8 lacks it."""
    snippet = ("def f(config: trt.IBuilderConfig):\n    trt = _trt()\n"
               "    config.hardware_compatibility_level = trt.HardwareCompatibilityLevel.SAME_COMPUTE_CAPABILITY\n")
    found = problems(collect_uses(snippet)[0])
    assert len(found) == 1 and "does not exist in TensorRT 10.8.0.43" in found[0]
    gated = snippet.replace("    config.hardware", "    if _since(10, 9):\n        config.hardware")
    assert problems(collect_uses(gated)[0]) == []
