"""Named places where a test may kill this process for real, to prove a crash there loses nothing.

`SMELTER_KILL_AT=<point>` makes the process SIGKILL itself when it reaches that point (nothing is
cleaned up, exactly as when the machine or an operator kills it); `SMELTER_KILL_SIGNAL=INT` (or
`TERM`) sends that signal instead, as Ctrl-C or a service manager would. Unset, a point costs one
environment lookup. The points are listed in POINTS so a test can name every one.
"""

from __future__ import annotations

import os
import signal

ENV = "SMELTER_KILL_AT"
SIGNAL_ENV = "SMELTER_KILL_SIGNAL"
POINTS = (
    "export", "calibration", "build", "accuracy", "benchmark",
    "run.started", "upload", "candidate.logged",
    "version.created", "event.composed", "event.recorded", "alias.moved",
    "notify.sending", "notify.sent", "run.finishing",
)


def reach(point: str) -> None:
    """Die here, by SIGKILL (or SMELTER_KILL_SIGNAL), when SMELTER_KILL_AT names this point."""
    if os.environ.get(ENV) == point:
        os.kill(os.getpid(), signal.Signals[f"SIG{os.environ.get(SIGNAL_ENV, 'KILL')}"])
