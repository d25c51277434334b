"""Processes a run started (its temporary Prefect server) are paused while it times engines and always resume:
at the block's end, when the block raises, after the longest pause, and on a stop signal's resume_all."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tasks.runtime import quiet_neighbours


def _cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


@pytest.fixture
def spinner() -> Iterator[subprocess.Popen]:
    """A process that uses CPU all the time, as a server's loops do now and then."""
    process = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    quiet_neighbours.pausable(process)
    try:
        yield process
    finally:
        quiet_neighbours.forget(process)
        process.kill()
        process.wait()


def _spins(pid: int, seconds: float = 0.3) -> bool:
    before = _cpu_ticks(pid)
    time.sleep(seconds)
    return _cpu_ticks(pid) > before


def test_a_registered_process_takes_no_cpu_while_engines_are_timed_and_runs_after(spinner: subprocess.Popen) -> None:
    assert _spins(spinner.pid)
    with quiet_neighbours.paused():
        time.sleep(0.05)
        assert _state(spinner.pid) == "T" and not _spins(spinner.pid), "paused while timing"
    assert _state(spinner.pid) != "T" and _spins(spinner.pid), "runs again after"


def test_it_resumes_when_the_timing_raises(spinner: subprocess.Popen) -> None:
    with pytest.raises(KeyboardInterrupt), quiet_neighbours.paused():
        raise KeyboardInterrupt
    assert _state(spinner.pid) != "T"


def test_no_pause_outlasts_its_bound(spinner: subprocess.Popen) -> None:
    with quiet_neighbours.paused(max_seconds=0.2):
        time.sleep(0.5)
        assert _state(spinner.pid) != "T", "resumed at the bound while the block went on"


def test_a_stop_signal_resumes_it_at_once(spinner: subprocess.Popen) -> None:
    with quiet_neighbours.paused():
        quiet_neighbours.resume_all()  # what smelter's stop-signal handler calls first
        assert _state(spinner.pid) != "T"


def test_a_process_not_registered_is_never_paused() -> None:
    other = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        with quiet_neighbours.paused():
            time.sleep(0.05)
            assert _state(other.pid) != "T"
    finally:
        other.kill()
        other.wait()
