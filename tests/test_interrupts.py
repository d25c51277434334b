"""A Ctrl-C (or SIGTERM) that a finalizer swallows still stops `smelter run`, one that lands while the command
still loads ends it as a stop, and runs never share a log.

Python ignores an exception raised inside `__del__` (it prints `Exception ignored in: ...`): a Ctrl-C that
lands while asyncio's transport finalizer runs was lost that way and the run carried on to promote. Here a
real `smelter run` gets its signal from inside a finalizer, at a stage or just before promotion: it must still
end as stopped (130 / 143, one line, no traceback) and promote nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from flows.cli import _append_and_remove, _new_log_file
from tests.fixtures.cli_runs import (REPO, RUN_TIMEOUT_S, CliSetup, champion_version, cli_setup_own_server,
                                     copy_artifacts, empty_store, run_statuses)

__all__ = ["cli_setup_own_server"]

# `python -c` for `smelter run` whose signal arrives inside a finalizer when the run reaches SWALLOW_AT.
SWALLOWING_LAUNCHER = """
import os, signal, sys
from tasks.runtime import killpoints

class Finalizer:
    def __del__(self):  # the signal's exception is raised here, and Python ignores it
        os.kill(os.getpid(), signal.Signals["SIG" + os.environ["SWALLOW_SIGNAL"]])
        for _ in range(100000):
            pass

def reach(point, real=killpoints.reach):
    if point == os.environ["SWALLOW_AT"]:
        Finalizer()
    real(point)

killpoints.reach = reach
from flows.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
@pytest.mark.parametrize(("point", "name", "code", "said"), [
    ("accuracy", "INT", 130, "interrupted (Ctrl-C)"),
    ("candidate.logged", "INT", 130, "interrupted (Ctrl-C)"),
    ("candidate.logged", "TERM", 143, "terminated (SIGTERM)"),
])
def test_a_signal_swallowed_by_a_finalizer_still_stops_the_run_before_promotion(
        point: str, name: str, code: int, said: str, cli_setup_own_server: CliSetup, tmp_path: Path) -> None:
    setup = cli_setup_own_server
    store = empty_store(setup, tmp_path / "store")
    artifacts = copy_artifacts(setup, tmp_path / "artifacts", drop_from="accuracy" if point == "accuracy" else None)
    env = setup.env | {"MLFLOW_TRACKING_URI": store, "SWALLOW_AT": point, "SWALLOW_SIGNAL": name}
    stopped = subprocess.run([sys.executable, "-c", SWALLOWING_LAUNCHER, "run", "-f", str(setup.pipelines),
                              "--artifacts", str(artifacts)], env=env, cwd=REPO, capture_output=True, text=True,
                             timeout=RUN_TIMEOUT_S)

    logs = "".join(p.read_text(errors="replace") for p in (artifacts / "_logs").glob("*.log"))
    assert "Exception ignored" in logs, "the signal was not swallowed: this case tests nothing"
    assert stopped.returncode == code, f"exit {stopped.returncode}:\n{stopped.stderr[-3000:]}"
    assert said in stopped.stderr and "Traceback" not in stopped.stderr, stopped.stderr[-3000:]
    assert "candidate" not in stopped.stdout, "the run printed its table after the signal"
    assert champion_version(store) is None, "the run promoted after it was told to stop"
    assert "RUNNING" not in run_statuses(store).values()


# `python -m flows.cli validate`, as a shell starts the command, whose stop signal arrives while flows/cli.py still
# imports its own modules: where a Ctrl-C pressed right after Enter lands on a slow CPU (an emulated AVX2 CPU
# spent over a second there)
LOADING_LAUNCHER = """
import builtins, os, runpy, signal, sys
load = builtins.__import__

def signalled(name, globals=None, *args, **kwargs):
    if name == "tasks.runtime" and (globals or {}).get("__name__") == "__main__":
        os.kill(os.getpid(), signal.Signals["SIG" + os.environ["STOP_SIGNAL"]])
    return load(name, globals, *args, **kwargs)

builtins.__import__ = signalled
sys.argv = [sys.argv[0], "validate"]
runpy.run_module("flows.cli", run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize(("name", "code", "said"), [("INT", 130, "interrupted (Ctrl-C)"),
                                                     ("TERM", 143, "terminated (SIGTERM)")])
def test_a_stop_while_the_command_loads_ends_it_with_one_line_and_its_code(name: str, code: int, said: str,
                                                                          tmp_path: Path) -> None:
    stopped = subprocess.run([sys.executable, "-c", LOADING_LAUNCHER], env=os.environ | {"STOP_SIGNAL": name},
                             cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert stopped.returncode == code, f"exit {stopped.returncode}:\n{stopped.stderr[-3000:]}"
    assert stopped.stderr == f"smelter: {said}\n", stopped.stderr[-3000:]


def test_runs_started_in_the_same_second_each_get_a_log_of_their_own(tmp_path: Path) -> None:
    logs = tmp_path / "_logs"
    first, second = _new_log_file(logs), _new_log_file(logs)
    assert first != second and first.exists() and second.exists()
    assert str(os.getpid()) in first.name

    first.write_text("the first run's output\n")
    checks = tmp_path / "checks.log"
    checks.write_text("the second run's server checks\n")
    _append_and_remove(checks, second)
    assert first.read_text() == "the first run's output\n", "one run's log replaced another's"
    assert second.read_text() == "the second run's server checks\n" and not checks.exists()
