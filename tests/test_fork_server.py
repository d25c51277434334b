"""The fork server the kill matrix starts its runs from (tests/fixtures/fork_server.py): a forked run says and
exits what `python -m flows.cli` says and exits, is a process of its own that a signal ends, and refuses an
environment its preloaded modules were not imported with."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fixtures.fork_server import ForkServer

REPO = Path(__file__).resolve().parents[1]


ENV = {key: value for key, value in os.environ.items() if not key.startswith("PYTEST_")}


@pytest.fixture
def forks(tmp_path: Path) -> Iterator[ForkServer]:
    modules = tmp_path / "modules.txt"
    modules.write_text("json\nargparse\nflows.early_stop\n")  # the last is never preloaded: it acts at import
    server = ForkServer(modules, ENV, REPO, tmp_path / "forks")
    yield server
    server.stop()


def test_a_forked_run_says_and_exits_what_the_command_says_and_exits(forks: ForkServer) -> None:
    for args in (["--help"], ["no-such-command"]):
        forked = forks.run(args, ENV, timeout=60)
        started = subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=REPO, env=ENV,
                                 capture_output=True, text=True, timeout=60)
        assert (forked.returncode, forked.stdout, forked.stderr) == (
            started.returncode, started.stdout, started.stderr)
    assert forked.returncode == 2 and "invalid choice" in forked.stderr


def test_a_forked_run_is_its_own_process_and_a_signal_ends_it(forks: ForkServer, tmp_path: Path) -> None:
    pipelines = tmp_path / "pipelines.yaml"
    pipelines.write_text("pipelines: {}\n")
    run = forks.start(["validate", "-f", str(pipelines)], ENV)
    assert run.pid not in (os.getpid(), os.getppid())
    run.send_signal(signal.SIGKILL)
    assert run.wait(timeout=60) == -signal.SIGKILL


def test_an_environment_read_at_import_cannot_change(forks: ForkServer) -> None:
    with pytest.raises(AssertionError, match="PREFECT_HOME"):
        forks.start(["--help"], ENV | {"PREFECT_HOME": "/elsewhere"})
    forked = forks.run(["--help"], ENV | {"MLFLOW_TRACKING_URI": "sqlite:///x.db"}, timeout=60)
    assert forked.returncode == 0
