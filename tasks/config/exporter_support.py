"""Which tasks Optimum's ONNX exporter supports for a model type, asked of Optimum itself.

Asking means importing Optimum's exporter (and with it transformers and torch: seconds), which a
cached `smelter run` never does otherwise. So the answer is kept in a small JSON file per
installed (optimum, optimum-onnx, transformers) versions, under $SMELTER_CACHE_DIR (default
~/.cache/smelter); any upgrade asks again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from tasks.runtime.whole_file import write_whole

TOOLS = ("optimum", "optimum-onnx", "transformers")


def cache_dir() -> Path:
    configured = os.environ.get("SMELTER_CACHE_DIR")
    if configured:
        return Path(configured)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "smelter"


def _versions() -> dict[str, str]:
    found = {}
    for tool in TOOLS:
        try:
            found[tool] = version(tool)
        except PackageNotFoundError:
            found[tool] = "absent"
    return found


def _cache_file() -> Path:
    digest = hashlib.sha256(json.dumps(_versions(), sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / f"onnx-export-tasks-{digest}.json"


def _ask_optimum(model_type: str) -> list[str] | None:
    import optimum.exporters.onnx.model_configs  # noqa: F401 - registers every ONNX export config
    from optimum.exporters.tasks import TasksManager

    try:
        tasks = TasksManager.get_supported_tasks_for_model_type(model_type, exporter="onnx",
                                                                 library_name="transformers")
    except KeyError:
        return None
    return sorted(tasks)


def supported_tasks(model_type: str) -> list[str] | None:
    """The export tasks Optimum supports for `model_type`, or None when it cannot export that type at all."""
    path = _cache_file()
    try:
        known = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        known = {}
    if not isinstance(known, dict):
        known = {}
    cached = known.get(model_type, False)
    if cached is None or (isinstance(cached, list) and all(isinstance(t, str) for t in cached)):
        return cached
    known[model_type] = _ask_optimum(model_type)
    _save(path, known)
    return known[model_type]


def _save(path: Path, known: dict[str, list[str] | None]) -> None:
    """Atomic, and best effort: a cache that cannot be written only costs the next run the import."""
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        write_whole(path, json.dumps(known, sort_keys=True))
