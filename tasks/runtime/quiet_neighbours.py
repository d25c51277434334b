"""Processes of this run paused while it times engines, so a timed call is the engine's alone.

The temporary Prefect server a run starts for itself shares the run's cores. While a benchmark ran it took
3-4% of a core, in wake-ups of 20-30 ms every few seconds (its services' loops, its task queue); on a
2-core machine a wake-up takes a core from one of the engine's two threads, and the call that meets it runs
that much longer. That was the in-run p99: minilm's engines read 34-51 ms in the run and 20-37 ms alone in
a fresh process (benchmarks/engine_alone.py); paused, 21-28 ms against 22-36. Nothing of the run needs the
server while engines are timed: a Prefect call made meanwhile (a batch of logs, a slot's renewal) waits
and is answered when it resumes, well inside its timeout, and a slot's lease outlives the longest pause
(LEASE_S in locks.py).

Only processes this run started and registered are paused (a lasting server is someone else's), for at
most MAX_PAUSE_S at a time, and they resume whatever ends the timing: its end, an exception, or a stop
signal (`resume_all`, called by the signal handler, which may run while a worker thread times).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
from collections.abc import Iterator

MAX_PAUSE_S = 20.0  # a slot's lease (60 s) and a Prefect call's timeout (60 s) outlast it with room to spare

_pausable: list[subprocess.Popen] = []
_paused: list[subprocess.Popen] = []
_lock = threading.RLock()  # re-entered by a signal handler that interrupts the main thread holding it


def pausable(process: subprocess.Popen) -> None:
    """Let timing pause `process` (a server this run started and stops)."""
    with _lock:
        _pausable.append(process)


def forget(process: subprocess.Popen) -> None:
    with _lock:
        if process in _pausable:
            _pausable.remove(process)
    _resume([process])


def resume_all() -> None:
    """Resume every paused process now (a stop signal: the run's stop path talks to its server)."""
    _resume(list(_paused))


def _resume(processes: list[subprocess.Popen]) -> None:
    with _lock:
        for process in processes:
            if process in _paused:
                _paused.remove(process)
                if process.poll() is None:
                    os.kill(process.pid, signal.SIGCONT)


@contextlib.contextmanager
def paused(max_seconds: float = MAX_PAUSE_S) -> Iterator[None]:
    """Pause the registered processes for the block, at most `max_seconds` (then they run on)."""
    with _lock:
        stopped = [p for p in _pausable if p not in _paused and p.poll() is None]
        for process in stopped:
            os.kill(process.pid, signal.SIGSTOP)
            _paused.append(process)
    deadline = threading.Timer(max_seconds, _resume, args=(stopped,))
    deadline.daemon = True
    deadline.start()
    try:
        yield
    finally:
        deadline.cancel()
        _resume(stopped)
