"""Every engine backend smelter can use, found through the `smelter.backends` entry points.

A backend registers its target settings class (a tasks.backends.base.TargetSpec subclass) under
its name; the built-in ones register the same way in pyproject.toml. The schema's target union,
`smelter validate`'s messages and the README's backend table (`python -m tasks.backends.table
--markdown`) are all read from here. Loading the registry imports only the settings classes, no
runtime (onnxruntime, TensorRT, torch), so checking a pipelines file stays fast anywhere.
"""

from __future__ import annotations

import argparse
import importlib
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from tasks.config.bounds import PRECISIONS
from tasks.runtime import stop_signals

GROUP = "smelter.backends"
DECLARED = ("devices", "source", "precisions", "implementation")


@dataclass(frozen=True)
class BackendInfo:
    """What a backend is, without importing its runtime.

    Args:
        name: the value of a target's `backend:` key (the entry point's name).
        target: its settings class; the rest is read from that class's declaration.
        distribution: the installed distribution that registered it.
    """

    name: str
    target: Any
    distribution: str

    @property
    def devices(self) -> tuple[str, ...]:
        return self.target.devices

    @property
    def source(self) -> str:
        return self.target.source

    @property
    def precisions(self) -> tuple[str, ...]:
        return self.target.precisions

    @property
    def implementation(self) -> str:
        return self.target.implementation

    @property
    def module(self) -> str:
        """The module of its `Backend` (part of every build key: a fix there rebuilds its engines)."""
        return self.implementation.partition(":")[0]

    def settings(self) -> list[str]:
        """The target keys it takes beyond name, backend and pool."""
        return [k for k in self.target.model_fields if k not in ("name", "backend", "pool")]


def _declaration_problem(entry: EntryPoint, target: Any) -> str | None:
    """Why the object an entry point names cannot declare a backend, or None."""
    fields = getattr(target, "model_fields", None)
    if not isinstance(target, type) or fields is None or "backend" not in fields:
        return "it is not a TargetSpec subclass with a `backend` field"
    literal = getattr(fields["backend"].annotation, "__args__", ())
    if tuple(literal) != (entry.name,):
        return f"its `backend` field must be Literal[{entry.name!r}], is {fields['backend'].annotation}"
    undeclared = [name for name in DECLARED if not hasattr(target, name)]
    if undeclared:
        return f"it does not declare {', '.join(undeclared)}"
    if not set(target.precisions) <= set(PRECISIONS):
        return f"precisions {target.precisions} are not all among {', '.join(PRECISIONS)}"
    return None


def discover() -> dict[str, BackendInfo]:
    """Every backend registered in the installed distributions, smelter's own first.

    A plugin that cannot load is left out with a warning: a broken third-party backend must not
    stop the pipelines that do not use it.
    """
    found: dict[str, BackendInfo] = {}
    entries = sorted(entry_points(group=GROUP), key=lambda e: (e.dist is None or e.dist.name != "smelter", e.name))
    for entry in entries:
        dist = entry.dist.name if entry.dist else "?"
        if entry.name in found:
            if found[entry.name].distribution != dist:
                warnings.warn(f"backend {entry.name} of {dist} ignored: {found[entry.name].distribution} "
                              "registers that name already", stacklevel=2)
            continue
        try:
            target = entry.load()
        except Exception as e:  # a third-party module may fail in any way
            # ... and a Ctrl-C raised while it imports may come out as a library's error (pydantic turns it
            # into a SchemaError): that is the user stopping the run, not a broken backend
            stop_signals.raise_if_stopped()
            warnings.warn(f"backend {entry.name} of {dist} ignored: cannot load {entry.value} ({e})", stacklevel=2)
            continue
        if problem := _declaration_problem(entry, target):
            warnings.warn(f"backend {entry.name} of {dist} ignored: {entry.value}: {problem}", stacklevel=2)
            continue
        found[entry.name] = BackendInfo(entry.name, target, dist)
    return found


class _Registry(Mapping[str, BackendInfo]):
    """The registered backends, discovered on first use (not at import: settings classes import the
    interface module, which imports this one)."""

    def __init__(self) -> None:
        self._found: dict[str, BackendInfo] | None = None

    def _all(self) -> dict[str, BackendInfo]:
        if self._found is None:
            self._found = discover()
        return self._found

    def __getitem__(self, name: str) -> BackendInfo:
        return self._all()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._all())


BACKENDS: Mapping[str, BackendInfo] = _Registry()


def load_implementation(info: BackendInfo) -> type:
    """The `Backend` class a backend declares, imported now (it may import a runtime)."""
    module, _, class_name = info.implementation.partition(":")
    return getattr(importlib.import_module(module), class_name)


def markdown() -> str:
    """The README's backend table."""
    rows = ["| backend | runs on | builds from | precisions | target settings | registered by |",
            "|---|---|---|---|---|---|"]
    for info in BACKENDS.values():
        settings = ", ".join(f"`{k}`" for k in info.settings()) or "none"
        source = "the PyTorch model" if info.source == "torch" else "the precision stage's ONNX"
        rows.append(f"| `{info.name}` | {' or '.join(info.devices)} | {source} | {', '.join(info.precisions)} "
                    f"| {settings} | {info.distribution} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tasks.backends.table", description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true", help="print the README's backend table")
    args = parser.parse_args(argv)
    if args.markdown:
        print(markdown())
    else:
        for info in BACKENDS.values():
            print(f"{info.name}: {'/'.join(info.devices)}, from {info.source}, {', '.join(info.precisions)} "
                  f"({info.implementation})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
