"""Content-addressed stage outputs: artifacts/<pipeline>/<stage>/<key>/ with a manifest.json.

The key hashes what determines the output (upstream keys, the stage's config, tool versions),
never a timestamp, so an unchanged re-run finds every stage already done. Writes go to a temp
dir that is renamed into place only when complete: a half-written stage never looks done.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
KEY_LENGTH = 16
STALE_TEMP_S = 24 * 3600


def tool_versions(*packages: str) -> dict[str, str]:
    """Installed versions of the packages a stage's output depends on."""
    versions = {}
    for name in packages:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "absent"
    return versions


def _canonical(value: Any) -> Any:
    if hasattr(value, "model_dump"):
        return _canonical(value.model_dump(mode="json"))
    if isinstance(value, dict):
        return {str(k): _canonical(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


def stage_key(stage: str, **parts: Any) -> str:
    """A stable hash of everything that determines a stage's output."""
    blob = json.dumps({"stage": stage, **_canonical(parts)}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:KEY_LENGTH]


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def tree_digest(root: Path) -> str:
    """Hash of the files under root (names and contents): a local model's identity."""
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(file_digest(path).encode())
    return digest.hexdigest()


def host_facts() -> dict[str, Any]:
    return {"hostname": socket.gethostname(), "machine": platform.machine(), "system": platform.system(),
            "python": platform.python_version(), "cpu_count": os.cpu_count()}


@dataclass(frozen=True)
class StageResult:
    """A finished stage output on disk; what downstream stages and the tracker read."""

    pipeline: str
    stage: str
    key: str
    path: Path
    manifest: dict[str, Any] = field(hash=False, compare=False)
    cached: bool = False

    def file(self, name: str) -> Path:
        return self.path / name

    @property
    def outputs(self) -> dict[str, Any]:
        """The stage's own results (metrics, shapes, ...) recorded in the manifest."""
        return self.manifest.get("outputs", {})


class ArtifactStore:
    """One root directory of stage outputs, shared by every pipeline and run."""

    def __init__(self, root: str | os.PathLike = "artifacts"):
        self.root = Path(root).resolve()

    def path(self, pipeline: str, stage: str, key: str) -> Path:
        return self.root / pipeline / stage / key

    def lookup(self, pipeline: str, stage: str, key: str) -> StageResult | None:
        """The finished output for this key, or None (a missing manifest or a file of the wrong size counts as absent).

        Sizes, not hashes, are checked: a lookup must stay cheap for a warm run over gigabyte engines.
        """
        final = self.path(pipeline, stage, key)
        try:
            manifest = json.loads((final / MANIFEST).read_text())
        except (OSError, ValueError):
            return None
        for name, meta in manifest.get("files", {}).items():
            target = final / name
            if not target.is_file() or target.stat().st_size != meta["bytes"]:
                return None
        return StageResult(pipeline, stage, key, final, manifest, cached=True)

    @contextlib.contextmanager
    def writing(self, pipeline: str, stage: str, key: str, *, inputs: dict[str, Any] | None = None,
                config: Any = None, tools: dict[str, str] | None = None) -> Iterator[StageWriter]:
        """Collect a stage's files in a temp dir; publish them atomically on success, drop them on error."""
        final = self.path(pipeline, stage, key)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=final.parent))
        writer = StageWriter(tmp, pipeline, stage, key, inputs or {}, _canonical(config), tools or {})
        try:
            yield writer
            writer.finish()
            _fsync_tree(tmp)
            _publish(tmp, final, key)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        writer.result = StageResult(pipeline, stage, key, final, writer.manifest, cached=False)

    def clean_temp(self, pipeline: str, older_than_s: float = STALE_TEMP_S) -> None:
        """Remove one pipeline's temp dirs left by a killed process: old enough that no live run is writing them."""
        cutoff = time.time() - older_than_s
        for tmp in (self.root / pipeline).glob("*/.*.*"):
            if tmp.stat().st_mtime < cutoff:
                shutil.rmtree(tmp, ignore_errors=True)


class StageWriter:
    """Handed to a stage while it writes; `dir` is where its files go."""

    def __init__(self, tmp: Path, pipeline: str, stage: str, key: str, inputs: dict, config: Any,
                 tools: dict[str, str]):
        self.dir = tmp
        self.outputs: dict[str, Any] = {}
        self.result: StageResult | None = None
        self._started = time.perf_counter()
        self.manifest: dict[str, Any] = {
            "pipeline": pipeline, "stage": stage, "key": key, "inputs": inputs, "config": config,
            "tools": tools, "host": host_facts()}

    def finish(self) -> None:
        files = {}
        for path in sorted(p for p in self.dir.rglob("*") if p.is_file()):
            files[str(path.relative_to(self.dir))] = {"sha256": file_digest(path), "bytes": path.stat().st_size}
        self.manifest |= {"outputs": _canonical(self.outputs), "files": files,
                          "seconds": round(time.perf_counter() - self._started, 3),
                          "created_unix": round(time.time(), 3)}
        (self.dir / MANIFEST).write_text(json.dumps(self.manifest, indent=2, default=str))


def _publish(tmp: Path, final: Path, key: str) -> None:
    """Move a finished temp dir into place; an output it replaces is moved aside first, never deleted before."""
    if final.exists():
        aside = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=final.parent))
        os.replace(final, aside)
        os.replace(tmp, final)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _fsync_dir(final.parent)


def _fsync_tree(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    _fsync_dir(root)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
