"""`smelter run` whose MLflow server, lasting Prefect server or own temporary Prefect server is killed
mid-run, for real.

What the user relies on: the run ends on its own in a bounded time (not after every call's retries), with
one line naming the server that stopped answering, no traceback, exit 1 (a failed run), and no alias
moved. Each case kills its own server; the module's other servers are left alone.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fixtures.cli_runs import (REPO, CliSetup, _prefect_server, champion_version, cli_setup_own_server,
                                     copy_artifacts, empty_store)
from tests.fixtures.servers import _stop, start_mlflow_server

pytestmark = [pytest.mark.slow, pytest.mark.waits]  # each waits out a lost server's retries
__all__ = ["cli_setup_own_server"]

ENDS_WITHIN_S = 240  # a safety net only: unbounded retries took ~10 minutes


class StartedRun:
    """`smelter run` as a user starts it (stage lines on stderr), its stderr read as it comes."""

    def __init__(self, setup: CliSetup, artifacts: Path, env: dict[str, str]):
        self.started = time.monotonic()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "flows.cli", "run", "--force", "-f", str(setup.pipelines), "--artifacts",
             str(artifacts)], env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.stderr: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.process.stderr:
            self.stderr.append(line)

    def wait_for_line(self, text: str, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while not any(text in line for line in self.stderr):
            assert self.process.poll() is None, f"the run ended before `{text}`:\n{''.join(self.stderr)[-3000:]}"
            assert time.monotonic() < deadline, f"no `{text}` after {timeout_s} s:\n{''.join(self.stderr)[-3000:]}"
            time.sleep(0.1)

    def wait(self) -> tuple[int, str, float]:
        """The exit code, the whole stderr and the seconds the run took (killed, failing the test, past the net)."""
        try:
            self.process.wait(timeout=ENDS_WITHIN_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            pytest.fail(f"the run did not end within {ENDS_WITHIN_S} s:\n{''.join(self.stderr)[-3000:]}")
        self._reader.join(timeout=10)
        self.process.stdout.close()
        return self.process.returncode, "".join(self.stderr), time.monotonic() - self.started


def _env(setup: CliSetup, store_uri: str) -> dict[str, str]:
    """The setup's environment with none of the client waits set: smelter's own defaults apply."""
    env = {k: v for k, v in setup.env.items() if not k.startswith(("MLFLOW_HTTP_", "PREFECT_CLIENT_"))}
    return env | {"MLFLOW_TRACKING_URI": store_uri}


def _assert_one_clear_line(stderr: str, names: str) -> None:
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and names in errors[0], stderr[-3000:]
    assert "stopped answering" in errors[0] and len(errors[0]) < 400, errors[0]
    assert "Traceback" not in stderr and "Error logging to API" not in stderr, stderr[-3000:]


@pytest.fixture
def mlflow_server_to_kill(cli_setup_own_server: CliSetup, tmp_path: Path) -> Iterator[tuple[str, subprocess.Popen]]:
    """A real `mlflow server` of this test's own, on a copy of a store whose tables are made (a quick start);
    its database is `tmp_path/mlflow-server/mlflow.db`, readable once the server is dead."""
    root = tmp_path / "mlflow-server"
    shutil.copytree(cli_setup_own_server.empty_store, root)
    server, uri = start_mlflow_server(root)
    try:
        yield uri, server
    finally:
        _stop(server)


def test_a_lost_mlflow_server_ends_the_run_with_one_line_naming_it(
        cli_setup_own_server: CliSetup, mlflow_server_to_kill: tuple[str, subprocess.Popen], tmp_path: Path) -> None:
    setup = cli_setup_own_server
    uri, server = mlflow_server_to_kill
    artifacts = copy_artifacts(setup, tmp_path / "artifacts")
    run = StartedRun(setup, artifacts, _env(setup, uri))
    run.wait_for_line("export")  # the pipeline's MLflow run is open: the server is in use
    os.killpg(server.pid, signal.SIGKILL)
    server.wait()

    code, stderr, seconds = run.wait()
    print(f"mlflow server killed mid-run: exit {code} after {seconds:.0f} s")
    assert code == 1, stderr[-3000:]
    _assert_one_clear_line(stderr, f"MLflow server at {uri}/")  # shown redacted: no path
    database = f"sqlite:///{tmp_path / 'mlflow-server' / 'mlflow.db'}"  # the dead server's registry, read directly
    assert champion_version(database) is None, "an alias moved in a run whose MLflow server was gone"


def test_a_lost_prefect_server_ends_the_run_with_one_line_naming_it(
        cli_setup_own_server: CliSetup, tmp_path: Path) -> None:
    setup = cli_setup_own_server
    store = empty_store(setup, tmp_path / "store")
    artifacts = copy_artifacts(setup, tmp_path / "artifacts")
    home = tmp_path / "prefect-home"
    shutil.copytree(setup.env["PREFECT_HOME"], home)  # a migrated database: a quick start
    env = _env(setup, store) | {"PREFECT_HOME": str(home)}
    server = _prefect_server(env, tmp_path / "prefect-server.log")
    try:
        run = StartedRun(setup, artifacts, env | {"PREFECT_API_URL": server.url})
        run.wait_for_line("export")
        os.killpg(server.process.pid, signal.SIGKILL)
        server.process.wait()
        code, stderr, seconds = run.wait()
    finally:
        server.stop()
    print(f"prefect server killed mid-run: exit {code} after {seconds:.0f} s")
    assert code == 1, stderr[-3000:]
    _assert_one_clear_line(stderr, f"PREFECT_API_URL {server.url.removesuffix('api')}")  # shown redacted
    assert champion_version(store) is None, "an alias moved in a run whose Prefect server was gone"


def _child_running(parent: int, text: str) -> int | None:
    """The pid of a child process of `parent` whose command line holds `text`, or None."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and text in command:
            return int(entry.name)
    return None


def test_a_lost_temporary_prefect_server_ends_the_run_with_one_line_naming_it(
        cli_setup_own_server: CliSetup, tmp_path: Path) -> None:
    """No PREFECT_API_URL: smelter's own temporary server, killed (as the out-of-memory killer would) while
    the run uses it. The failure may first show as the flow ends, after the settings naming that server
    are gone: the run still names it, and the logs queued for it do not hold the exit."""
    setup = cli_setup_own_server
    store = empty_store(setup, tmp_path / "store")
    artifacts = copy_artifacts(setup, tmp_path / "artifacts")
    home = tmp_path / "prefect-home"
    shutil.copytree(setup.env["PREFECT_HOME"], home)  # a migrated database: a quick start
    env = {k: v for k, v in _env(setup, store).items() if k != "PREFECT_API_URL"} | {"PREFECT_HOME": str(home)}
    run = StartedRun(setup, artifacts, env)
    run.wait_for_line("export")
    server = _child_running(run.process.pid, "flows.temporary_server")
    assert server is not None, "no temporary Prefect server under the run"
    os.kill(server, signal.SIGKILL)

    code, stderr, seconds = run.wait()
    print(f"temporary prefect server killed mid-run: exit {code} after {seconds:.0f} s")
    assert code == 1, stderr[-3000:]
    _assert_one_clear_line(stderr, f"temporary Prefect server (pid {server})")
    assert "killed by SIGKILL" in stderr and "Logging error" not in stderr, stderr[-3000:]
    assert champion_version(store) is None, "an alias moved in a run whose Prefect server was gone"
