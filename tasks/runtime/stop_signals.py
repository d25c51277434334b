"""The stop signals (Ctrl-C, SIGTERM) this process received, kept where their exception can be lost.

A signal's exception raised inside a finalizer is printed and ignored by Python, and one raised inside a
library's `except BaseException` may be swallowed; the run then carried on and exited 0. So the signal is
recorded as well as raised, and the run stops at its next safe point (a stage's start, a progress line,
before a registry version is made) with `raise_if_stopped`.
"""

from __future__ import annotations

import signal

received: list[int] = []  # in the order they came; the first one decides the exit code


class Terminated(BaseException):
    """SIGTERM as an exception, so a stopped run unwinds like Ctrl-C: the stage being written drops its
    temp dir, MLflow runs end KILLED, the temporary Prefect server stops. (Inside a flow Prefect turns
    SIGTERM into its own TerminationSignal first, then sends it again to this handler.)"""


def raise_for(signum: int) -> None:
    raise KeyboardInterrupt() if signum == signal.SIGINT else Terminated()


def raise_if_stopped() -> None:
    """Raise the stop signal received earlier, if any."""
    if received:
        raise_for(received[0])
