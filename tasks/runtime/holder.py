"""Who holds something: a process named by its host, its boot, its pid and its start time.

Every lock, slot, temp dir and MLflow run that outlives a process records one of these, so that
whoever finds it later can tell a live holder from a dead one: a pid alone is reused, and a pid
on another host (or from before a reboot) cannot be checked from here at all.
"""

from __future__ import annotations

import functools
import hashlib
import os
import socket
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


def process_start(pid: int) -> str | None:
    """A process's start time in clock ticks since boot; None when no such process exists."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return "?"  # alive, but its start time cannot be read here


@functools.cache
def machine_id() -> str:
    """This host in this boot: process ids are comparable only within it."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = "no-boot-id"
    return hashlib.sha256(f"{socket.gethostname()}/{boot}".encode()).hexdigest()[:10]


@dataclass(frozen=True)
class Holder:
    """One process, as another process (here or on another host) can later check it."""

    host: str
    machine: str
    pid: int
    start: str

    @classmethod
    def current(cls) -> Holder:
        pid = os.getpid()
        return cls(socket.gethostname(), machine_id(), pid, process_start(pid) or "?")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Holder:
        return cls(str(data["host"]), str(data["machine"]), int(data["pid"]), str(data["start"]))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def here(self) -> bool:
        """Whether this process can check the holder: same host, same boot."""
        return self.machine == machine_id()

    def gone(self) -> bool:
        """True only when the holder ran on this host in this boot and that process no longer exists
        (its pid is free, or taken by a process that started later). Another host's: never."""
        if not self.here:
            return False
        now = process_start(self.pid)
        return now is None or (now != "?" and self.start != "?" and now != self.start)

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host}"
