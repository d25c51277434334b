"""Load a saved exported program (`torch.export.load`) in less than half the time.

Most of `torch.export.load` is spent answering the same two questions again and again: torch's
deserializer asks `typing.get_type_hints` of a schema class once per JSON object (23,000 times for
a 16-layer Llama prefill, of 23 classes) and parses a symbolic shape with `sympy.sympify` once per
occurrence (2,600 times, 39 distinct expressions). Both answers depend only on their arguments, so
while a program loads, the deserializer's module sees memoising copies of those two modules
(nothing else in the process does). On the CPU, the engine's 16-layer prefill program loaded
2.4x [1.99, 2.88] as fast (median 1.09 s against 2.47 s), its decode step 2.2x [1.8, 2.74]
(benchmarks/program_load.py). Where a torch release no longer reads those modules by those names
in its deserializer, programs load unchanged, only slower.
"""

from __future__ import annotations

import threading
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

_LOCK = threading.Lock()


class Memo:
    """Answers of one function, by key; `hits` counts the questions answered again."""

    def __init__(self) -> None:
        self.answers: dict[Any, Any] = {}
        self.hits = 0

    def get(self, key: Any, answer: Callable[[], Any]) -> Any:
        if key in self.answers:
            self.hits += 1
            return self.answers[key]
        value = self.answers[key] = answer()
        return value


def _with(module: types.ModuleType, **overrides: Any) -> types.ModuleType:
    """A copy of `module` with some names replaced: plain attribute lookups, as fast as the module's own."""
    copy = types.ModuleType(module.__name__)
    copy.__dict__.update(vars(module))
    copy.__dict__.update(overrides)
    return copy


def _memo_typing(typing_module: types.ModuleType, memo: Memo) -> types.ModuleType:
    original = typing_module.get_type_hints

    def get_type_hints(obj: Any, globalns: Any = None, localns: Any = None, include_extras: bool = False) -> Any:
        try:
            hints = memo.get((obj, id(globalns), id(localns), include_extras),
                             lambda: original(obj, globalns, localns, include_extras))
        except TypeError:  # an unhashable object: not one of the schema classes this is for
            return original(obj, globalns, localns, include_extras)
        return dict(hints)  # a copy: a caller may change what it gets

    return _with(typing_module, get_type_hints=get_type_hints)


def _memo_sympy(sympy_module: types.ModuleType, memo: Memo) -> types.ModuleType:
    original = sympy_module.sympify

    def sympify(a: Any, locals: dict[str, Any] | None = None, **kwargs: Any) -> Any:  # noqa: A002 (sympy's name)
        if not isinstance(a, str) or kwargs or not isinstance(locals, dict):
            return original(a, locals=locals, **kwargs)
        # The names are the deserializer's own symbols and functions, alive for the whole load, so
        # their identities name them.
        key = (a, tuple((name, id(value)) for name, value in locals.items()))
        return memo.get(key, lambda: original(a, locals=locals))

    return _with(sympy_module, sympify=sympify)


@contextmanager
def memoised_deserializer() -> Iterator[tuple[Memo, Memo] | None]:
    """While in it, torch's export deserializer sees memoising `typing` and `sympy`; yields their memos
    (None where this torch's deserializer does not use those modules by those names)."""
    from torch._export.serde import serialize

    module_globals = vars(serialize)
    if not (isinstance(module_globals.get("typing"), types.ModuleType)
            and isinstance(module_globals.get("sympy"), types.ModuleType)):
        yield None
        return
    with _LOCK:
        typing_module, sympy_module = module_globals["typing"], module_globals["sympy"]
        memos = Memo(), Memo()
        module_globals["typing"] = _memo_typing(typing_module, memos[0])
        module_globals["sympy"] = _memo_sympy(sympy_module, memos[1])
        try:
            yield memos
        finally:
            module_globals["typing"], module_globals["sympy"] = typing_module, sympy_module


def load_program(path: Path) -> torch.export.ExportedProgram:
    """torch.export.load, memoised (see the module's docstring)."""
    with memoised_deserializer():
        return torch.export.load(str(path))
