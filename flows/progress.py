"""What a person watching a run sees: one line per stage, and nothing else on the terminal.

Each line also goes through Prefect's run logger, so a deployed run shows it in the Prefect UI and
`prefect deployment run ... --watch` streams it. `smelter run` routes everything libraries print
(warnings, tracer noise, MLflow's run links, Prefect's per-task lines, native code writing to the
file descriptors) into the run's log file with `captured_output`; `--verbose` leaves it all on the
terminal, `--quiet` keeps only failures. Lines go to stderr, so `smelter run --json` leaves stdout
to the summary. On a TTY a live line under them says which stages run now and for how long (for a
benchmark, its round and how close its interval is to the target).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from rich.console import Console

from tasks.measure import rounds as measure
from tasks.measure.stats import MIN_ROUNDS
from tasks.runtime import stop_signals

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


_roots: dict[str, str | None] = {}  # flow run id -> its outermost flow run's id (None: it is the outermost)


def _outermost_flow_run_id() -> str | None:
    """The top-level flow run above the current subflow run, or None when the current run is top-level.

    `prefect deployment run ... --watch` streams the logs of the one flow run it started, not of its
    subflows (the pipelines, the builds), so their lines are sent there too. Asked of the API once per
    subflow run."""
    from prefect.client.orchestration import get_client
    from prefect.context import FlowRunContext, TaskRunContext

    flow_context, task_context = FlowRunContext.get(), TaskRunContext.get()
    current = (str(task_context.task_run.flow_run_id) if task_context is not None and task_context.task_run
               else str(flow_context.flow_run.id) if flow_context is not None and flow_context.flow_run else None)
    if current is None:
        return None
    if current not in _roots:
        root, run_id = None, current
        with contextlib.suppress(Exception), get_client(sync_client=True) as client:  # no root: no copy
            while (parent_task := client.read_flow_run(run_id).parent_task_run_id) is not None:
                run_id = str(client.read_task_run(parent_task).flow_run_id)
                root = run_id
        _roots[current] = root
    return _roots[current]


def _watch_logger() -> logging.Logger:
    """Sends to the API only (no console handler): the copy of a subflow's line for its top-level run."""
    from prefect.logging.handlers import APILogHandler

    logger = logging.getLogger("smelter.watch")
    if not logger.handlers:
        logger.addHandler(APILogHandler())
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger


def _terminal_stream() -> TextIO:
    return _terminal or sys.stderr


def _emit(markup: str, plain: str, *, failure: bool = False) -> None:
    stop_signals.raise_if_stopped()  # a safe point: an interrupt swallowed where it was raised ends the run
    logger = _run_logger()
    if logger is not None:
        (logger.warning if failure else logger.info)(plain)
        if (root := _outermost_flow_run_id()) is not None:
            _watch_logger().log(logging.WARNING if failure else logging.INFO, plain, extra={"flow_run_id": root})
    if _level == QUIET and not failure:
        return
    if logger is not None and _terminal is None:
        return  # no `smelter run` capture (a worker, `serve`, --verbose): Prefect's console handler prints it
    with _live.paused():
        Console(file=_terminal_stream(), highlight=False, soft_wrap=True).print(markup)


class _LiveLine:
    """The line under the finished ones on a TTY: every running stage with its elapsed time, redrawn
    each second by a daemon thread and cleared before a finished line is printed."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._shown = False
        self._ticker: threading.Thread | None = None

    def wanted(self) -> bool:
        """Only while `smelter run` owns the terminal (`captured_output`): elsewhere (a worker, a flow run
        from Python) other writers' lines would cut through it."""
        return _level == NORMAL and _terminal is not None and _terminal.isatty()

    def text(self) -> str:
        now = time.perf_counter()
        parts = [f"{label} {stage} {now - started:.0f}s" + (f" ({_details[(label, stage)]})"
                                                            if (label, stage) in _details else "")
                 for (label, stage), started in list(_started.items())]
        return "⏳ " + " · ".join(parts) if parts else ""

    def draw(self) -> None:
        with self._lock:
            if not self.wanted():
                return
            text = self.text()
            width = shutil.get_terminal_size((100, 20)).columns - 1
            if len(text) > width:
                text = text[:width - 1] + "…"
            stream = _terminal_stream()
            stream.write("\r\x1b[2K" + text)
            stream.flush()
            self._shown = bool(text)
            if text and (self._ticker is None or not self._ticker.is_alive()):
                self._ticker = threading.Thread(target=self._tick, name="smelter-progress", daemon=True)
                self._ticker.start()

    def _tick(self) -> None:
        while True:
            time.sleep(1.0)
            with self._lock:
                if not _started or not self.wanted():
                    self._clear()
                    return
                self.draw()

    def _clear(self) -> None:
        if self._shown:
            stream = _terminal_stream()
            stream.write("\r\x1b[2K")
            stream.flush()
            self._shown = False

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Clear the live line, print, draw it again under what was printed."""
        with self._lock:
            self._clear()
            try:
                yield
            finally:
                if _started:
                    self.draw()


_live = _LiveLine()
_details: dict[tuple[str, str], str] = {}
_last_width: dict[int, tuple[float, str]] = {}  # id(rounds) -> (when computed, the text)
WIDTH_EVERY_S = 1.0  # an interval over every pair costs a few ms: recompute it at most this often


def benchmark_round(rounds: measure.Rounds, precision: float) -> None:
    """Called by tasks/measure/rounds.py after every round: on a TTY, the running benchmark's round count and its
    widest interval against the target. Costs nothing when no live line is shown."""
    running = [key for key in _started if key[1] == "benchmark"]
    if not running or not _live.wanted():
        return
    detail = f"round {rounds.count}"
    if rounds.count >= MIN_ROUNDS and rounds.pairs:
        when, text = _last_width.get(id(rounds), (0.0, ""))
        if not text or time.perf_counter() - when >= WIDTH_EVERY_S:
            with contextlib.suppress(ValueError, ZeroDivisionError):
                worst = max(rounds.ratio(base, other).half_width for base, other in rounds.pairs)
                text = f"±{worst:.1%} of ±{precision:.0%} target"
                _last_width.clear()
                _last_width[id(rounds)] = (time.perf_counter(), text)
        detail += f", {text}" if text else ""
    for key in running:
        _details[key] = detail
    _live.draw()


measure.round_observer = benchmark_round


def stage_started(label: str, stage: str) -> None:
    stop_signals.raise_if_stopped()  # a safe point: an interrupt swallowed where it was raised ends the run
    _started[(label, stage)] = time.perf_counter()
    if _level == VERBOSE:
        _emit(f"[cyan]▶[/] {label:<28} {stage:<10} running", f"{label} {stage}: running")
    _live.draw()


def stage_done(label: str, stage: str, *, cached: bool, kept: str | None = None) -> None:
    """`kept`: the stage ran again but kept its published output, and why (not `cached`: it took the time)."""
    seconds = time.perf_counter() - _started.pop((label, stage), time.perf_counter())
    _details.pop((label, stage), None)
    word = f"kept {seconds:.1f}s: {kept}" if kept else "cached" if cached else f"done {seconds:.1f}s"
    colour = "yellow" if cached or kept else "green"
    _emit(f"[green]✔[/] {label:<28} {stage:<10} [{colour}]{word}[/]", f"{label} {stage}: {word}")


def stage_failed(label: str, stage: str, error: str) -> None:
    _started.pop((label, stage), None)
    _details.pop((label, stage), None)
    first = error.splitlines()[0] if error else ""
    _emit(f"[red]✘[/] {label:<28} {stage:<10} failed: {first}", f"{label} {stage}: failed: {first}", failure=True)
    stop_if_a_server_was_lost()


def stop_if_a_server_was_lost(error: BaseException | None = None) -> None:
    """After a failure: when the MLflow server or the Prefect API no longer answers, every later stage and
    call would wait out its client's retries to fail the same way; end the run now with the one line that
    says which (`ServerLost`). Costs a health request to each server, only when something failed."""
    from flows.prefect_server import api_lost, limit_prefect_retries
    from tasks.registry import tracking

    if isinstance(error, tracking.ServerLost):
        raise error
    lost = tracking.server_lost()
    if not lost and (lost := api_lost()):
        # the Prefect API is gone: the flows ending on the way out (each marked Failed through it) fail at once
        # instead of each waiting out PREFECT_CLIENT_MAX_RETRIES again
        limit_prefect_retries(0)
    if lost:
        raise tracking.ServerLost(lost) from error


def candidate_done(label: str, status: str, reasons: list[str]) -> None:
    colour = {"promoted": "bold green", "passed": "green", "pending": "yellow", "rejected": "yellow",
              "failed": "red"}[status]
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
            with _live.paused():
                _started.clear(), _details.clear()  # a stage left running (Ctrl-C) keeps no live line past the capture
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
