"""Named places where a test may kill this process for real, to prove a crash there loses nothing.

`SMELTER_KILL_AT=<point>` makes the process SIGKILL itself when it reaches that point (nothing is
cleaned up, exactly as when the machine or an operator kills it); `SMELTER_KILL_SIGNAL=INT` (or
`TERM`) sends that signal instead, as Ctrl-C or a service manager would; `PAUSE` writes the point's
name to the file `SMELTER_PAUSE_FILE` names and waits there, so a test can press Ctrl-C in a real
terminal while the run is at that point. Unset, a point costs one environment lookup. The points
are listed in POINTS so a test can name every one.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

ENV = "SMELTER_KILL_AT"
SIGNAL_ENV = "SMELTER_KILL_SIGNAL"
PAUSE_FILE_ENV = "SMELTER_PAUSE_FILE"
PAUSE_S = 300
POINTS = (
    "export", "calibration", "build", "accuracy", "benchmark",
    "run.started", "upload", "candidate.logged",
    "version.created", "event.composed", "event.recorded", "alias.moved",
    "notify.sending", "notify.sent", "run.finishing",
)


def reach(point: str) -> None:
    """Die here, by SIGKILL (or SMELTER_KILL_SIGNAL), when SMELTER_KILL_AT names this point."""
    if os.environ.get(ENV) != point:
        return
    how = os.environ.get(SIGNAL_ENV, "KILL")
    if how == "PAUSE":
        Path(os.environ[PAUSE_FILE_ENV]).write_text(point)
        time.sleep(PAUSE_S)
        return
    os.kill(os.getpid(), signal.Signals[f"SIG{how}"])
