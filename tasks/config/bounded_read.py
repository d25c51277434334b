"""Reading a file a user named, without ever blocking on it or reading more than is sane."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path


def read_bounded(path: Path, limit: int) -> bytes:
    """At most `limit` + 1 bytes of a regular file (one more than allowed, so the caller can tell).

    A directory, FIFO or device raises OSError before anything is read: reading a FIFO would wait
    for a writer forever, and /dev/zero never ends.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
        if not stat.S_ISREG(mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        chunks, left = [], limit + 1
        while left and (chunk := os.read(fd, min(left, 1 << 20))):
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)
