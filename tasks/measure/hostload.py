"""How busy this host was while a measurement ran: the evidence for calling it contended.

Load averages lag by a minute, so the decisive figure is the share of the CPU that other
processes used during the measurement, from /proc/stat minus this process's own CPU time. The
temporary Prefect server is another process, so it counts; so does this process's own other work
(Prefect's log and event workers, MLflow's, the progress line, another task's thread): the CPU of
every Python thread but the measuring one (alive when the measurement ends: those workers live as long as
the run) is counted with the other processes, and said apart.
"""

from __future__ import annotations

import os
import platform
import threading
import time
from dataclasses import dataclass
from pathlib import Path

PROC_STAT = Path("/proc/stat")
CPUINFO = Path("/proc/cpuinfo")
# Other processes using more than this share of all cores during a measurement make it contended
# (the default of the pipeline setting benchmark.contended_above).
CONTENDED_SHARE = 0.25


def cpu_model() -> str:
    try:
        for line in CPUINFO.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Model", "cpu model"):
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _busy_ticks() -> int | None:
    """All cores' busy time (user, nice, system, irq, softirq, steal) in clock ticks, or None off Linux."""
    try:
        fields = PROC_STAT.read_text().splitlines()[0].split()[1:]
    except (OSError, IndexError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[:8])
    return user + nice + system + irq + softirq + steal


def _own_ticks() -> int:
    times = os.times()
    return round((times.user + times.system) * os.sysconf("SC_CLK_TCK"))


def _thread_ticks(tid: int) -> int:
    """One thread's CPU time in clock ticks (0 once it has ended, or off Linux)."""
    try:
        fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0
    return int(fields[11]) + int(fields[12])  # utime, stime


def _other_threads() -> dict[int, int]:
    """CPU ticks so far of this process's Python threads other than the calling one."""
    me = threading.get_native_id()
    return {t.native_id: _thread_ticks(t.native_id) for t in threading.enumerate()
            if t.native_id is not None and t.native_id != me}


def _load() -> float:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return float("nan")


@dataclass
class HostLoad:
    """Load averages at start and end, and the share of all cores other processes used in between."""

    cpu: str
    cores: int
    load_start: float
    load_end: float | None = None
    foreign_cpu_share: float | None = None
    own_threads_cpu_share: float | None = None  # of it, this process's threads other than the measuring one
    contended_above: float = CONTENDED_SHARE

    @property
    def contended(self) -> bool:
        return self.foreign_cpu_share is not None and self.foreign_cpu_share > self.contended_above

    def as_dict(self) -> dict[str, object]:
        return {"cpu": self.cpu, "cores": self.cores, "load_start": self.load_start, "load_end": self.load_end,
                "foreign_cpu_share": self.foreign_cpu_share, "own_threads_cpu_share": self.own_threads_cpu_share,
                "contended": self.contended,
                "contended_above": self.contended_above}


class LoadWatch:
    """Context manager: `with LoadWatch() as load: measure()`, then read `load`. `contended_above`: the share
    of all cores other processes may use before the measurement counts as contended."""

    def __init__(self, contended_above: float = CONTENDED_SHARE):
        self._contended_above = contended_above

    def __enter__(self) -> HostLoad:
        self._wall, self._busy, self._own = time.monotonic(), _busy_ticks(), _own_ticks()
        self._threads = _other_threads()
        self.load = HostLoad(cpu_model(), os.cpu_count() or 1, _load(), contended_above=self._contended_above)
        return self.load

    def __exit__(self, *exc: object) -> None:
        self.load.load_end = _load()
        busy = _busy_ticks()
        wall = time.monotonic() - self._wall
        if busy is None or self._busy is None or wall <= 0:
            return
        threads = sum(ticks - self._threads.get(tid, 0) for tid, ticks in _other_threads().items())
        foreign = (busy - self._busy) - (_own_ticks() - self._own) + max(threads, 0)
        capacity = wall * os.sysconf("SC_CLK_TCK") * self.load.cores
        self.load.foreign_cpu_share = round(min(max(foreign / capacity, 0.0), 1.0), 3)
        self.load.own_threads_cpu_share = round(min(max(threads / capacity, 0.0), 1.0), 3)
