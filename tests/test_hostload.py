"""The contention share counts smelter's own other work: a busy thread beside the measuring one is not the
engine's time."""

from __future__ import annotations

import threading
import time

from tasks.measure.hostload import LoadWatch

BUSY_CPU_S = 0.5


def _spin(cpu_seconds: float) -> None:
    """Busy for this much of the calling thread's own CPU time, however busy the machine is."""
    until = time.thread_time() + cpu_seconds
    while time.thread_time() < until:
        sum(range(1000))


def _worker(spun: threading.Event, stop: threading.Event) -> None:
    """A long-lived background worker (like Prefect's log worker) that is busy for a while."""
    _spin(BUSY_CPU_S)
    spun.set()
    stop.wait()


def test_another_thread_of_this_process_counts_as_contention_and_is_said_apart() -> None:
    spun, stop = threading.Event(), threading.Event()
    worker = threading.Thread(target=_worker, args=(spun, stop))
    try:
        started = time.monotonic()
        with LoadWatch(contended_above=0.01) as load:
            worker.start()
            spun.wait()  # the measuring thread waits: all the CPU it sees is the other thread's
        wall = time.monotonic() - started
    finally:
        stop.set()
        worker.join()
    assert load.own_threads_cpu_share is not None, load.as_dict()
    assert load.own_threads_cpu_share * wall * load.cores >= 0.8 * BUSY_CPU_S, (load.as_dict(), wall)
    assert load.foreign_cpu_share >= load.own_threads_cpu_share
    assert load.contended


def test_the_measuring_threads_own_work_is_not_contention() -> None:
    started = time.monotonic()
    with LoadWatch() as load:
        _spin(BUSY_CPU_S)
    wall = time.monotonic() - started
    assert load.own_threads_cpu_share is not None, load.as_dict()
    assert load.own_threads_cpu_share * wall * load.cores < 0.1 * BUSY_CPU_S, (load.as_dict(), wall)
