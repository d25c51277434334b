"""One line per stage on stderr, so a user watching `smelter run` sees which candidate is where.

Kept on stderr so `smelter run --json` leaves stdout to the summary.
"""

from __future__ import annotations

import sys
import time

from rich.console import Console

_console = Console(stderr=True, highlight=False, soft_wrap=True)
_started: dict[tuple[str, str], float] = {}


def stage_started(label: str, stage: str) -> None:
    _started[(label, stage)] = time.perf_counter()
    _console.print(f"[cyan]▶[/] {label:<28} {stage:<10} running")


def stage_done(label: str, stage: str, *, cached: bool) -> None:
    seconds = time.perf_counter() - _started.pop((label, stage), time.perf_counter())
    word = "[yellow]cached[/]" if cached else f"[green]done[/] {seconds:.1f}s"
    _console.print(f"[green]✔[/] {label:<28} {stage:<10} {word}")


def stage_failed(label: str, stage: str, error: str) -> None:
    _started.pop((label, stage), None)
    _console.print(f"[red]✘[/] {label:<28} {stage:<10} failed: {error.splitlines()[0] if error else ''}")


def candidate_done(label: str, status: str, reasons: list[str]) -> None:
    colour = {"promoted": "bold green", "passed": "green", "rejected": "yellow", "failed": "red"}[status]
    why = f" ({'; '.join(reasons)})" if reasons else ""
    _console.print(f"[{colour}]●[/] {label:<28} {status}{why}")


def message(text: str) -> None:
    print(text, file=sys.stderr)
