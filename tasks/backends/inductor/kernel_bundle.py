"""The Triton kernels of smelter's own ops, compiled at build and shipped in the engine directory.

Inductor's compile cache (and a precompiled graph) holds the kernels Inductor generated, not those
that smelter's ops launch themselves (decode_products.KERNELS: the decode step's products, norms,
gate and attention; encoder_ops.KERNELS: an encoder's attention). Triton compiles those on their
first launch in each process whose Triton cache lacks them, about a second each, several per decode
batch size. The build therefore packs the Triton cache entries of those kernels into
`triton_kernels.zip`; a load unpacks the missing ones
into this process's Triton cache, where Triton finds them as if it had compiled them. An entry is
keyed by Triton itself (kernel source, constants, GPU target, Triton version): one this machine
cannot use is never looked up.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import zipfile
from pathlib import Path
from typing import Any

from tasks.backends.inductor import decode_products, encoder_ops

FILE = "triton_kernels.zip"
BUNDLED_KERNELS = decode_products.KERNELS + encoder_ops.KERNELS


def triton_cache_dir() -> Path | None:
    """Where Triton keeps compiled kernels in this process, or None without Triton."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return None
    try:
        from triton import knobs

        where = knobs.cache.dir
    except (ImportError, AttributeError):
        where = None
    where = where or os.environ.get("TRITON_CACHE_DIR")
    if not where:
        try:
            from triton.runtime.cache import default_cache_dir

            where = default_cache_dir()
        except ImportError:
            where = str(Path.home() / ".triton" / "cache")
    return Path(where)


def _entries(cache: Path) -> list[Path]:
    """Cache entries (one folder each) that hold one of smelter's kernels."""
    if not cache.is_dir():
        return []
    return sorted(d for d in cache.iterdir()
                  if d.is_dir() and "." not in d.name and any((d / f"{k}.json").is_file() for k in BUNDLED_KERNELS))


def pack(path: Path) -> dict[str, Any]:
    """Write smelter's compiled kernels from this process's Triton cache to `path` (none: no file)."""
    cache = triton_cache_dir()
    entries = _entries(cache) if cache else []
    if not entries:
        return {"kernels": 0}
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as z:
        for entry in entries:
            for f in sorted(entry.iterdir()):
                if f.is_file():
                    z.write(f, f"{entry.name}/{f.name}")
    return {"kernels": len(entries), "bytes": path.stat().st_size}


def install(path: Path) -> int:
    """Unpack the kernels `path` holds that this process's Triton cache lacks; how many."""
    cache = triton_cache_dir()
    if cache is None or not path.is_file():
        return 0
    installed = 0
    with zipfile.ZipFile(path) as z:
        names = z.namelist()
        for entry in sorted({n.split("/", 1)[0] for n in names if "/" in n}):
            target = cache / entry
            if target.exists() or "." in entry or not entry.strip():
                continue
            cache.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=f"{entry}.tmp.", dir=cache))
            for name in names:
                if name.startswith(f"{entry}/") and "/" not in name[len(entry) + 1:]:
                    (staging / name[len(entry) + 1:]).write_bytes(z.read(name))
            _repoint_groups(staging, target)
            try:
                staging.rename(target)  # atomic: Triton never sees half an entry
                installed += 1
            except OSError:  # another process installed it first
                shutil.rmtree(staging, ignore_errors=True)
    return installed


def _repoint_groups(staging: Path, target: Path) -> None:
    """Triton's group files name their members by absolute path: make them name the installed ones."""
    for group in staging.glob("__grp__*.json"):
        data = json.loads(group.read_text())
        children = data.get("child_paths")
        if isinstance(children, dict):
            data["child_paths"] = {name: str(target / Path(p).name) for name, p in children.items()}
            group.write_text(json.dumps(data))
