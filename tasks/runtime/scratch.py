"""This process's temp dir: every library temp file of a run lives under it, and a dead run's is removed.

ONNX Runtime's quantizer (`ort.quant.*`), MLflow's staging copies and compilers' build files go to
tempfile's directory, and a killed run cannot clean them up. So a smelter process points
`tempfile.tempdir` and $TMPDIR at `<temp>/smelter-tmp.<machine>-<pid>-<start>.<random>` for its whole
life (not per stage: a process's stages may overlap in threads), removes it at exit, and, when it
starts, removes the ones whose process is gone (this host only; another host's are not ours to judge).
Its subprocesses inherit that $TMPDIR for their own temp files only: locks live in the host's lock dir
(tasks/runtime/locks.py `lock_dir`), never under a temp dir, so no process's locks go when another one exits.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import threading
from pathlib import Path

from tasks.runtime.holder import Holder, machine_id

PREFIX = "smelter-tmp."
_lock = threading.Lock()
_own: Path | None = None


def _owner(path: Path) -> Holder | None:
    parts = path.name.removeprefix(PREFIX).split(".")
    fields = parts[0].split("-") if len(parts) == 2 else []
    if len(fields) != 3 or not fields[1].isdigit():
        return None
    return Holder(host="", machine=fields[0], pid=int(fields[1]), start=fields[2])


def sweep(root: Path) -> list[Path]:
    """Remove the scratch dirs under `root` whose process is gone; returns what was removed."""
    removed = []
    for path in root.glob(f"{PREFIX}*"):
        owner = _owner(path)
        if owner is not None and owner.gone() and path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def activate() -> Path:
    """Move this process's temp files into a dir of its own (once; later calls return it)."""
    global _own
    with _lock:
        if _own is not None:
            return _own
        system = Path(tempfile.gettempdir())
        sweep(system)
        me = Holder.current()
        own = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{machine_id()}-{me.pid}-{me.start}.", dir=system))
        _own = own
        tempfile.tempdir = str(own)
        os.environ["TMPDIR"] = str(own)  # for the subprocesses it starts
        atexit.register(_remove, own)
        return own


def _remove(own: Path) -> None:
    shutil.rmtree(own, ignore_errors=True)
