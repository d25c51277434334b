"""Precompiled graphs: an engine's graphs compiled ahead by Dynamo (`aot_compile`), loaded without retracing.

A warm start through `torch.compile` deserialises each exported program, retraces it with Dynamo and
looks its compiled code up in the compile cache, for every graph and shape. Here the build also
saves, for each shape it warms (the prefill's prompt shapes, the decode step's batch and cache
length), Dynamo's own precompiled function (`torch.compile(..., fullgraph=True).aot_compile`,
`save_compiled_function`); a load reads it back with `torch.compiler.load_compiled_function`,
which needs neither the exported program nor a trace.

The function compiled is the graph module's own `forward` (graph_weights.Bound for the prefill,
inductor's cached decode step), with the module passed as its first argument, with the Inductor
options `torch.compile(module)` gets, except CUDA graphs: CUDA-graph trees do not survive the
serialisation (on the H200, torch 2.11, a loaded decode step ran without them, 5.4 ms a step
against 1.1), so the decode step is precompiled without them and each decode session records its
own CUDA graph (inductor.DecodeSession), and a prefill replayed with CUDA graphs is not
precompiled. Precompiling cost about 11 s a graph at build (Llama-3.2-1B shape, H200). The
compiled code reads only the module's weights and caches, not the exported program inside it: the
build checks this by calling it on a shell of the module whose graph is None, and a load calls it
the same way, so a warm start reads no exported program and traces nothing.

Every Dynamo guard is dropped (`drop_all_guards`: torch 2.11 cannot serialise some, and they
would check what the engine checks itself): the engine's sidecar ties it to one GPU arch and one
torch (inductor.load_problem), the weights are the engine's own, and `Precompiled.matches` takes a
call only with the exact shapes, dtype and device the function was compiled for; any other call
goes through `torch.compile` as before. Where this torch has no `aot_compile`, or a function
fails to compile, save or load, the engine is built and loaded without it (the sidecar says why).
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

SUFFIX = ".precompiled"


def drop_all_guards(entries: Sequence[Any]) -> list[bool]:
    """Keep no Dynamo guard: the engine checks arch, torch and input shapes itself."""
    return [False for _ in entries]


def unavailable() -> str | None:
    """Why this torch cannot precompile graphs, or None."""
    _enable()  # torch 2.11 gives torch.compile's result an aot_compile only when enabled
    if not hasattr(torch.compiler, "load_compiled_function"):
        return f"torch {torch.__version__} has no torch.compiler.load_compiled_function"
    if not hasattr(torch.compile(drop_all_guards, fullgraph=True), "aot_compile"):
        return f"torch {torch.__version__}'s torch.compile has no aot_compile"
    return None


def _enable() -> None:
    if hasattr(torch._dynamo.config, "enable_aot_compile"):
        torch._dynamo.config.enable_aot_compile = True  # off by default in torch 2.11


def signature(inputs: Sequence[Any]) -> list[Any]:
    """What a call must match to run a precompiled function: each input tensor's shape, dtype and
    device (lists of tensors, as the decode step's caches, element by element)."""
    out: list[Any] = []
    for value in inputs:
        if isinstance(value, (list, tuple)):
            out.append(signature(value))
        elif isinstance(value, torch.Tensor):
            out.append([list(value.shape), str(value.dtype), value.device.type])
        else:
            out.append(repr(value))
    return out


def compile_graph(module: torch.nn.Module, shell: torch.nn.Module, inputs: Sequence[Any], options: dict[str, Any],
                  path: Path, key: list[Any]) -> dict[str, Any]:
    """Precompile `module`'s forward for these inputs' shapes with Inductor `options`, check that it runs
    on `shell` (the module without its exported program), and save it to `path`; return what a load
    needs to know (`key`: the signature a call must match, see `signature`)."""
    _enable()
    started = time.perf_counter()
    compiler = torch.compile(type(module).forward, fullgraph=True, dynamic=False,
                             options={**options, "guard_filter_fn": drop_all_guards})
    with torch.no_grad():
        compiled = compiler.aot_compile(((module, *inputs), {}))
        compiled(shell, *inputs)
    compiled.save_compiled_function(str(path))
    return {"file": path.name, "signature": key, "bytes": path.stat().st_size,
            "seconds": round(time.perf_counter() - started, 3)}


def load_function(path: Path) -> Callable[..., Any]:
    """A saved precompiled function, guard checks off (it keeps none)."""
    _enable()
    data = path.read_bytes()
    try:
        fn = torch.compiler.load_compiled_function(io.BytesIO(data))
    except RuntimeError as e:
        # torch 2.13 unpickles an import's source by installing a guard, which needs a tracing context
        if "ongoing trace" not in str(e):
            raise
        from torch._guards import TracingContext, tracing

        with tracing(TracingContext(None)):
            fn = torch.compiler.load_compiled_function(io.BytesIO(data))
    if hasattr(fn, "disable_guard_check"):
        fn.disable_guard_check()
    return fn


@dataclass
class Precompiled:
    """One precompiled function of an engine directory, read on its first use."""

    path: Path
    signature: list[Any]
    _fn: Callable[..., Any] | None = None

    def matches(self, inputs: Sequence[Any]) -> bool:
        return all(t.is_contiguous() for t in inputs if isinstance(t, torch.Tensor)) and signature(inputs) == self.signature

    def function(self) -> Callable[..., Any]:
        if self._fn is None:
            self._fn = load_function(self.path)
        return self._fn


def entries(engine_dir: Path, recorded: list[dict[str, Any]] | None) -> list[Precompiled]:
    """The sidecar's precompiled functions of one graph whose files are there."""
    return [Precompiled(engine_dir / r["file"], r["signature"]) for r in recorded or []
            if (engine_dir / r["file"]).is_file()]
