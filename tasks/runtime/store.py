"""Content-addressed stage outputs: artifacts/<pipeline>/<stage>/<key>/ with a manifest.json.

The key hashes what determines the output (upstream keys, the stage's config, tool versions, the
stage's own code), never a timestamp, so an unchanged re-run finds every stage already done.
Writes go to a temp dir that is renamed into place only when complete: a half-written stage never
looks done. An output is trusted only when every file matches the sha256 its manifest recorded; a
damaged one is moved aside (kept for inspection) and counts as absent, so its stage rebuilds.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import platform
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

from tasks.runtime.holder import Holder, machine_id
from tasks.runtime.locks import file_lock, raise_if_lease_lost
from tasks.runtime.whole_file import write_whole

MANIFEST = "manifest.json"
MANIFEST_DIGEST = "manifest_sha256"
KEY_LENGTH = 16
CORRUPT_DIR = "_corrupt"
LOCKS_DIR = "_locks"
TOOL_CACHES = "_cache"
HASH_CACHE = Path(TOOL_CACHES) / "sha256.json"
FOREIGN_TEMP_S = 24 * 3600
CORRUPT_KEEP_S = 7 * 24 * 3600  # moved-aside damaged outputs are kept this long for inspection
_ASIDE_TIME = "%Y%m%dT%H%M%S.%fZ"

log = logging.getLogger("smelter.store")


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


def _stamp(stat: os.stat_result) -> list[int]:
    """What changes whenever a file's bytes do: size, mtime, ctime (a writer cannot set it back), inode."""
    return [stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino]


_known: dict[str, tuple[list[int], str]] = {}  # path -> (stamp, sha256) hashed or verified in this process
_known_lock = threading.Lock()


def _note_digest(path: Path, stamp: list[int], sha256: str) -> None:
    with _known_lock:
        _known[os.path.abspath(path)] = (stamp, sha256)


def file_digest(path: Path, *, reread: bool = False) -> str:
    """sha256 of the file's bytes; a file unchanged (same stamp) since this process last hashed or verified
    it is not read again, so checking one engine at several steps of a run costs one read. `reread`: read
    every byte whatever the stamp says (bytes can change under an unchanged stamp: bit rot, a tool that
    restores times), for the checks that decide what a deploy system gets."""
    stamp = _stamp(path.stat())
    if not reread:
        with _known_lock:
            known = _known.get(os.path.abspath(path))
        if known is not None and known[0] == stamp:
            return known[1]
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    sha256 = digest.hexdigest()
    if _stamp(path.stat()) == stamp:  # unchanged while it was read
        _note_digest(path, stamp, sha256)
    return sha256


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
    """A finished stage output on disk; what downstream stages and the tracker read.

    `repaired` says why a damaged earlier output of this key was moved aside, and where, when this
    run rebuilt it. `kept` says why this run produced the stage again yet kept the published output
    (a re-measurement that was contended too): it is `cached`, but it took the time of a new one.
    """

    pipeline: str
    stage: str
    key: str
    path: Path
    manifest: dict[str, Any] = field(hash=False, compare=False)
    cached: bool = False
    repaired: str | None = None
    kept: str | None = None

    def file(self, name: str) -> Path:
        return self.path / name

    @property
    def content(self) -> str:
        """A digest of its files' hashes, for downstream keys: a rebuilt output that differs in any byte (a
        build that is not bit-reproducible) is judged and measured again, never credited with the old one's."""
        files = {name: meta.get("sha256") for name, meta in sorted(self.manifest.get("files", {}).items())}
        return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()[:KEY_LENGTH]

    @property
    def outputs(self) -> dict[str, Any]:
        """The stage's own results (metrics, shapes, ...) recorded in the manifest."""
        return self.manifest.get("outputs", {})


class ArtifactStore:
    """One root directory of stage outputs, shared by every pipeline and run."""

    def __init__(self, root: str | os.PathLike = "artifacts"):
        self.root = Path(root).resolve()
        self.hashes = HashCache(self.root / HASH_CACHE)

    def path(self, pipeline: str, stage: str, key: str) -> Path:
        return self.root / pipeline / stage / key

    def lookup(self, pipeline: str, stage: str, key: str) -> StageResult | None:
        """The verified output for this key, or None; a damaged one is moved aside first."""
        return self.check(pipeline, stage, key)[0]

    def check(self, pipeline: str, stage: str, key: str, *,
              repair: bool = True) -> tuple[StageResult | None, str | None]:
        """The verified output for this key (or None), and what was wrong with the entry when it was damaged.

        Every file must match the sha256 in the manifest (the hash cache spares re-reading files
        unchanged since they were last hashed). With `repair` a damaged entry is moved to
        `<stage>/_corrupt/<key>-<UTC time>`, under the key's lock, and the message says where.
        """
        final = self.path(pipeline, stage, key)
        result, problem = self._verify(pipeline, stage, key, final)
        if problem is None or not repair:
            return result, problem
        with self.key_lock(pipeline, stage, key):
            result, problem = self._verify(pipeline, stage, key, final)
            if problem is None:
                return result, None
            aside = final.parent / CORRUPT_DIR / f"{key}-{datetime.now(timezone.utc).strftime(_ASIDE_TIME)}"
            aside.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.replace(final, aside)
            except FileNotFoundError:
                return None, None
        note = f"{pipeline}/{stage}/{key}: {problem}; moved aside to {aside.relative_to(self.root)}, rebuilding"
        log.warning(note)
        return None, note

    def _verify(self, pipeline: str, stage: str, key: str, final: Path) -> tuple[StageResult | None, str | None]:
        if not final.exists():
            return None, None
        try:
            manifest = json.loads((final / MANIFEST).read_text())
            if MANIFEST_DIGEST not in manifest:
                return None, f"{MANIFEST} has no {MANIFEST_DIGEST} (written by an older smelter, or edited)"
            if manifest.pop(MANIFEST_DIGEST) != _manifest_digest(manifest):
                return None, f"{MANIFEST} does not match its own sha256"
            if (manifest.get("pipeline"), manifest.get("stage"), manifest.get("key")) != (pipeline, stage, key):
                return None, (f"{MANIFEST} is for {manifest.get('pipeline')}/{manifest.get('stage')}/"
                              f"{manifest.get('key')}, not this entry (copied or linked from elsewhere)")
            files = manifest["files"]
            expected = {str(name): (int(meta["bytes"]), str(meta["sha256"])) for name, meta in files.items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            return None, f"unreadable manifest ({type(e).__name__})"
        actual = {str(p.relative_to(final)) for p in final.rglob("*") if p.is_file()} - {MANIFEST}
        if unlisted := sorted(actual - set(expected)):
            return None, f"files not in the manifest: {', '.join(unlisted[:5])}"
        for name, (size, sha256) in sorted(expected.items()):
            path = final / name
            try:
                stat = path.stat()
            except OSError:
                return None, f"{name} is missing"
            if stat.st_size != size:
                return None, f"{name} has {stat.st_size} bytes, the manifest says {size}"
            if self.hashes.digest(path, stat) != sha256:
                return None, f"{name} does not match its sha256 in the manifest"
        self.hashes.save()
        return StageResult(pipeline, stage, key, final, manifest, cached=True), None

    @contextlib.contextmanager
    def key_lock(self, pipeline: str, stage: str, key: str) -> Iterator[None]:
        """This host's lock on one key (a file lock in the store): one builder, one repairer at a time."""
        path = self.root / LOCKS_DIR / pipeline / stage / f"{key}.lock"
        path.parent.mkdir(parents=True, exist_ok=True)
        with file_lock(path, reentrant=True, what=f"{pipeline} {stage} {key}"):
            yield

    @contextlib.contextmanager
    def writing(self, pipeline: str, stage: str, key: str, *, inputs: dict[str, Any] | None = None,
                config: Any = None, tools: dict[str, str] | None = None) -> Iterator[StageWriter]:
        """Collect a stage's files in a temp dir; publish them atomically on success, drop them on error."""
        final = self.path(pipeline, stage, key)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = owned_temp_dir(final.parent, key)
        writer = StageWriter(tmp, pipeline, stage, key, inputs or {}, _canonical(config), tools or {},
                             self.root / TOOL_CACHES)
        try:
            yield writer
            writer.finish()
            _fsync_tree(tmp)
            raise_if_lease_lost()  # a key's slot that may be another's now: its holder publishes nothing
            _publish(tmp, final, key)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        for name, meta in writer.manifest["files"].items():
            self.hashes.remember(final / name, meta["sha256"])
        self.hashes.save()
        writer.result = StageResult(pipeline, stage, key, final, writer.manifest, cached=False)

    def clean(self, pipeline: str) -> list[Path]:
        """Remove what one pipeline's dead writers and old repairs left behind; the paths removed.

        A temp dir's name says which process on which boot of which host made it: one of this host's
        dead processes is removed at once, a live one never; one from another host (or of an older
        naming) only after FOREIGN_TEMP_S, since its process cannot be asked. A damaged output moved
        aside goes after CORRUPT_KEEP_S (its name holds the UTC time it was moved), so repairs
        cannot fill the disk.
        """
        removed = []
        for tmp in (self.root / pipeline).glob("*/.*.*"):
            if tmp.is_dir() and _writer_gone(tmp):
                shutil.rmtree(tmp, ignore_errors=True)
                removed.append(tmp)
        now = datetime.now(timezone.utc)
        for aside in (self.root / pipeline).glob(f"*/{CORRUPT_DIR}/*"):
            moved = _moved_at(aside.name)
            if moved is not None and (now - moved).total_seconds() > CORRUPT_KEEP_S:
                shutil.rmtree(aside, ignore_errors=True)
                removed.append(aside)
        return removed


def _moved_at(name: str) -> datetime | None:
    """When an entry named `<key>-<UTC time>` was moved aside, or None for a name of another form."""
    try:
        return datetime.strptime(name.rpartition("-")[2], _ASIDE_TIME).replace(tzinfo=timezone.utc)
    except ValueError:
        return None


class HashCache:
    """sha256 of files keyed by (path, size, mtime_ns, ctime_ns, inode): warm runs skip re-reading big engines.

    Any change to a file changes its size, mtime or ctime (ctime cannot be set back by a writer),
    so an entry is only reused for the very bytes it was computed from. The cache file carries a
    digest of its own entries; one that is unreadable or fails that check is ignored entirely.
    """

    def __init__(self, path: Path):
        self.path = path
        self._entries: dict[str, list[Any]] | None = None
        self._dirty = False
        self._lock = threading.RLock()
        self.hits = 0

    def _load(self) -> dict[str, list[Any]]:
        if self._entries is None:
            self._entries = {}
            with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
                saved = json.loads(self.path.read_text())
                if saved["digest"] == _entries_digest(saved["entries"]):
                    self._entries = dict(saved["entries"])
        return self._entries

    def digest(self, path: Path, stat: os.stat_result) -> str:
        stamp = _stamp(stat)
        with self._lock:
            entry = self._load().get(str(path))
        if isinstance(entry, list) and len(entry) == 2 and entry[0] == stamp:
            self.hits += 1
            _note_digest(path, stamp, str(entry[1]))
            return str(entry[1])
        sha256 = file_digest(path)
        if _stamp(path.stat()) == stamp:  # unchanged while it was read
            with self._lock:
                self._load()[str(path)] = [stamp, sha256]
                self._dirty = True
        return sha256

    def remember(self, path: Path, sha256: str) -> None:
        with self._lock:
            stamp = _stamp(path.stat())
            self._load()[str(path)] = [stamp, sha256]
            self._dirty = True
        _note_digest(path, stamp, sha256)

    def save(self) -> None:
        """Write the cache atomically (temp file + rename); entries of files gone are dropped."""
        with self._lock:
            if not self._dirty or self._entries is None:
                return
            self._entries = {p: e for p, e in self._entries.items() if os.path.exists(p)}
            blob = json.dumps({"entries": self._entries, "digest": _entries_digest(self._entries)})
            self._dirty = False
        try:  # best effort, like reading it: without the cache files are only hashed again
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_whole(self.path, blob)
        except OSError as e:
            log.warning("hash cache %s not saved: %s", self.path, e)


def _manifest_digest(manifest: dict[str, Any]) -> str:
    """The manifest's own sha256: its outputs (metrics, measurements) are results too, and must not drift."""
    return hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()


def _entries_digest(entries: Any) -> str:
    return hashlib.sha256(json.dumps(entries, sort_keys=True).encode()).hexdigest()


class StageWriter:
    """Handed to a stage while it writes; `dir` is where its files go."""

    def __init__(self, tmp: Path, pipeline: str, stage: str, key: str, inputs: dict, config: Any,
                 tools: dict[str, str], tool_caches: Path):
        self.dir = tmp
        self._tool_caches = tool_caches
        self.outputs: dict[str, Any] = {}
        self.result: StageResult | None = None
        self._started = time.perf_counter()
        self.manifest: dict[str, Any] = {
            "pipeline": pipeline, "stage": stage, "key": key, "inputs": inputs, "config": config,
            "tools": tools, "host": host_facts()}

    def cache_dir(self, tool: str) -> Path:
        """A cache one tool keeps across outputs (TensorRT's timing cache): outside every output, never hashed."""
        path = self._tool_caches / tool
        path.mkdir(parents=True, exist_ok=True)
        return path

    def finish(self) -> None:
        files = {}
        for path in sorted(p for p in self.dir.rglob("*") if p.is_file()):
            files[str(path.relative_to(self.dir))] = {"sha256": file_digest(path), "bytes": path.stat().st_size}
        self.manifest |= {"outputs": _canonical(self.outputs), "files": files,
                          "seconds": round(time.perf_counter() - self._started, 3),
                          "created_unix": round(time.time(), 3)}
        self.manifest = json.loads(json.dumps(self.manifest, default=str))  # exactly what a lookup reads back
        sealed = self.manifest | {MANIFEST_DIGEST: _manifest_digest(self.manifest)}
        (self.dir / MANIFEST).write_text(json.dumps(sealed, indent=2))


def owned_temp_dir(parent: Path, key: str) -> Path:
    """A temp dir named `.<key>.<machine>-<pid>-<start>.<random>`, so a later run can tell whether its writer lives."""
    me = Holder.current()
    return Path(tempfile.mkdtemp(prefix=f".{key}.{me.machine}-{me.pid}-{me.start}.", dir=parent))


def _writer_gone(tmp: Path) -> bool:
    parts = tmp.name.split(".")
    owner = parts[2].split("-") if len(parts) == 4 else []
    if len(owner) == 3 and owner[0] == machine_id() and owner[1].isdigit():
        return Holder("", owner[0], int(owner[1]), owner[2]).gone()
    try:
        return tmp.stat().st_mtime < time.time() - FOREIGN_TEMP_S
    except OSError:
        return False


def _publish(tmp: Path, final: Path, key: str) -> None:
    """Move a finished temp dir into place; an output it replaces is moved aside first, never deleted before."""
    if final.exists():
        aside = owned_temp_dir(final.parent, key)
        os.replace(final, aside / "replaced")
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
