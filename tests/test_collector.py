"""The cycle collector held off while a process loads (tasks/runtime/collector.py): each case runs in a
process of its own, as the collector is the process's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.fixtures.cli_runs import REPO, cold_run
from tests.fixtures.fork_server import COLLECTOR_STATE

__all__ = ["cold_run"]  # the session fixture this module uses


def _in_a_process(code: str) -> dict:
    done = subprocess.run([sys.executable, "-c", f"import gc, json\nfrom tasks.runtime import collector\n{code}"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_a_held_collector_collects_again_once_loaded_and_skips_what_was_loaded() -> None:
    state = _in_a_process(
        "collector.hold(); held = gc.isenabled(); import email.parser, http.client; before = gc.get_freeze_count()\n"
        "collector.loaded(); print(json.dumps({'held': held, 'enabled': gc.isenabled(), 'before': before,"
        " 'frozen': gc.get_freeze_count()}))")
    assert state["held"] is False and state["enabled"] is True
    assert state["before"] == 0 and state["frozen"] > 10_000, "what the process loaded is not frozen"


def test_a_caller_that_turned_the_collector_off_keeps_it_off_and_nothing_frozen() -> None:
    state = _in_a_process("gc.disable(); collector.hold(); collector.loaded()\n"
                          "print(json.dumps({'enabled': gc.isenabled(), 'frozen': gc.get_freeze_count()}))")
    assert state == {"enabled": False, "frozen": 0}


def test_loaded_without_a_hold_changes_nothing() -> None:
    """A program that imports smelter and calls its functions (the tests, a notebook) keeps its own collector."""
    state = _in_a_process("collector.loaded()\n"
                          "print(json.dumps({'enabled': gc.isenabled(), 'frozen': gc.get_freeze_count()}))")
    assert state == {"enabled": True, "frozen": 0}


def test_a_complete_smelter_run_ends_with_the_collector_on_and_its_libraries_frozen(cold_run: Path) -> None:
    """The session's cold `smelter run` (export to promotion, the real command's entry point) ran its stages
    with the collector on: a run that never resumed it would keep every cycle a long build makes."""
    state = json.loads((cold_run / COLLECTOR_STATE).read_text())
    assert state["enabled"] is True
    assert state["frozen"] > 100_000, state
