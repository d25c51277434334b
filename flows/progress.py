"""What a person watching a run sees: one line per stage, and nothing else on the terminal.

Each line also goes through Prefect's run logger, so a deployed run shows it in the Prefect UI.
`smelter run` routes everything libraries print (warnings, tracer noise, MLflow's run links,
Prefect's per-task lines, native code writing to the file descriptors) into the run's log file
with `captured_output`; `--verbose` leaves it all on the terminal, `--quiet` keeps only failures.
Lines go to stderr, so `smelter run --json` leaves stdout to the summary.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from rich.console import Console

QUIET, NORMAL, VERBOSE = 0, 1, 2
_level = NORMAL
_terminal: TextIO | None = None  # None: whatever sys.stderr is when a line is written
_started: dict[tuple[str, str], float] = {}


def set_level(level: int) -> None:
    global _level
    _level = level


def _run_logger() -> logging.Logger | logging.LoggerAdapter | None:
    from prefect.context import FlowRunContext, TaskRunContext
    from prefect.logging import get_run_logger

    if FlowRunContext.get() is None and TaskRunContext.get() is None:
        return None
    return get_run_logger()


def _deployed() -> bool:
    """A run a worker or `serve` started: its terminal is the worker's, the run logger is the place.

    Read from the run context: `prefect.runtime.deployment.id` asks the API for the flow run on every
    call (a new client each time), and this is asked for every progress line."""
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    if context is not None and context.flow_run is not None:
        return context.flow_run.deployment_id is not None
    from prefect.runtime import deployment  # a task without its flow's context: ask the API

    return deployment.id is not None


def _emit(markup: str, plain: str, *, failure: bool = False) -> None:
    logger = _run_logger()
    if logger is not None:
        (logger.warning if failure else logger.info)(plain)
    if _level == QUIET and not failure or logger is not None and (_level == VERBOSE or _deployed()):
        return  # quiet; or Prefect's own console handler already prints the run logger's line
    Console(file=_terminal or sys.stderr, highlight=False, soft_wrap=True).print(markup)


def stage_started(label: str, stage: str) -> None:
    _started[(label, stage)] = time.perf_counter()
    if _level == VERBOSE:
        _emit(f"[cyan]▶[/] {label:<28} {stage:<10} running", f"{label} {stage}: running")


def stage_done(label: str, stage: str, *, cached: bool, kept: str | None = None) -> None:
    """`kept`: the stage ran again but kept its published output, and why (not `cached`: it took the time)."""
    seconds = time.perf_counter() - _started.pop((label, stage), time.perf_counter())
    word = f"kept {seconds:.1f}s: {kept}" if kept else "cached" if cached else f"done {seconds:.1f}s"
    colour = "yellow" if cached or kept else "green"
    _emit(f"[green]✔[/] {label:<28} {stage:<10} [{colour}]{word}[/]", f"{label} {stage}: {word}")


def stage_failed(label: str, stage: str, error: str) -> None:
    _started.pop((label, stage), None)
    first = error.splitlines()[0] if error else ""
    _emit(f"[red]✘[/] {label:<28} {stage:<10} failed: {first}", f"{label} {stage}: failed: {first}", failure=True)


def candidate_done(label: str, status: str, reasons: list[str]) -> None:
    colour = {"promoted": "bold green", "passed": "green", "rejected": "yellow", "failed": "red"}[status]
    why = f" ({'; '.join(reasons)})" if reasons else ""
    _emit(f"[{colour}]●[/] {label:<28} {status}{why}", f"{label}: {status}{why}", failure=status == "failed")


def message(text: str) -> None:
    _emit(text, text, failure=text.startswith(("warning", "error")))


def _fd_stream(stream: TextIO, fd: int) -> bool:
    with contextlib.suppress(AttributeError, OSError, ValueError, io.UnsupportedOperation):
        return stream.fileno() == fd
    return False


@contextlib.contextmanager
def captured_output(log_path: Path) -> Iterator[None]:
    """Send everything written to stdout and stderr (Python or native) to `log_path` meanwhile;
    progress lines keep the terminal."""
    global _terminal
    log_path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    real_stderr = _fd_stream(sys.stderr, 2)
    saved = os.dup(1), os.dup(2)
    terminal = os.fdopen(os.dup(2), "w", buffering=1, encoding="utf-8", errors="replace") if real_stderr else sys.stderr
    previous = _terminal
    with open(log_path, "a", buffering=1, encoding="utf-8", errors="replace") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        _terminal = terminal
        try:
            with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
                yield
        finally:
            for stream in (sys.stdout, sys.stderr, log):
                with contextlib.suppress(OSError, ValueError):
                    stream.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            _terminal = previous
            if terminal is not sys.stderr:
                terminal.close()
