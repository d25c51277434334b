"""A file written whole: a temp file beside it, renamed over it.

A reader (another run, a killed run's successor) sees the old bytes or the new, never a torn file, and
a write that fails leaves no temp file behind (a killed one leaves `.NAME.*.tmp`, which nothing reads).
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path


def write_whole(path: Path, data: bytes | str) -> None:
    """`data` (str: as UTF-8) into `path` at once; the file gets the permissions a plain write would."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "xb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
