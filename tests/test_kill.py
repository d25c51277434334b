"""`smelter run` killed for real (SIGKILL) at every point that matters, or stopped by Ctrl-C in a real
terminal, then run again on the same machine state.

Where a killed run leaves a slot taken in the Prefect database (a stage's, or the promotion's at
version.created), every run starts its own temporary Prefect server on the module's one PREFECT_HOME, as
on a user's machine with nothing configured: the database (and the slots taken in it) outlives each run.
The other points are recovered from the MLflow store, the artifacts and the receiver, whatever the
server, and their runs share the module's lasting server (a cached run then costs about 4 s of CPU less);
a promotion killed there leaves its slot on that server, which the next run takes over. The MLflow store
and the artifact store of a case are the killed run's. After each kill the next run completes without
waiting on the dead run's slots; no slot stays taken; no file of the killed run is left in
$TMPDIR; no partial or corrupt artifact is used; the alias points at an existing, passing version
whose registered files match their manifest; no MLflow run stays RUNNING; and the promotion reaches
the webhook receiver exactly once (a repeat after a lost answer carries the same delivery id, which
is how a receiver drops it).
"""

from __future__ import annotations

import contextlib
import os
import pty
import select
import signal
import sys
import time
from pathlib import Path

import pytest

from tasks.runtime.killpoints import POINTS
from tests.fixtures.cli_runs import (MODEL, PIPELINE, REPO, CliSetup, assert_artifacts_intact, assert_registry_sound,
                                     cli_setup, cli_setup_own_server, copy_artifacts, deliveries, empty_store,
                                     held_slots, left_in_tmpdir, prefect_server_processes, run_cli, run_statuses,
                                     summary)

pytestmark = pytest.mark.slow
__all__ = ["cli_setup", "cli_setup_own_server"]  # the module-scoped fixtures these tests share

STAGE_OF_POINT = {"export": "export", "calibration": "precision", "build": "build", "accuracy": "accuracy",
                  "benchmark": "benchmark"}
# Points where the run holds a slot of the temporary server's database: each stage's, and the promotion's
# (version.created is the first point that holds it; the points after it take the same slot the same way)
ON_TEMPORARY_SERVERS = (*STAGE_OF_POINT, "version.created")
ON_A_LASTING_SERVER = tuple(point for point in POINTS if point not in ON_TEMPORARY_SERVERS)
CTRL_C_WITHIN_S = 10


def _prefect_home(setup: CliSetup) -> Path:
    return Path(setup.env["PREFECT_HOME"])


def _assert_next_run_completes(setup: CliSetup, store: str, artifacts: Path, tmp_path: Path) -> dict:
    """The run after a killed one: not held up by anything the dead run held, and nothing left behind."""
    result = run_cli(setup, store, artifacts)
    again = summary(result)
    assert "waiting, held by" not in result.stderr, f"the next run waited on a dead run's slot:\n{result.stderr}"
    (candidate,) = again["candidates"]
    assert candidate["status"] in ("promoted", "passed") and candidate["decision"]["holds_alias"], candidate
    assert_artifacts_intact(artifacts)
    champion = assert_registry_sound(store, tmp_path)
    assert candidate["model_version"] == champion
    assert held_slots(_prefect_home(setup)) == {}, "a Prefect slot is still taken after the run"
    assert left_in_tmpdir(setup) == [], "files of a killed run are left in $TMPDIR"
    assert prefect_server_processes(_prefect_home(setup)) == []
    return again


def _killed_then_completed(setup: CliSetup, point: str, tmp_path: Path) -> None:
    """A run SIGKILLed at `point`, then the next run on the same machine state."""
    setup.receiver.events.clear()
    store = empty_store(setup, tmp_path / "store")
    artifacts = copy_artifacts(setup, tmp_path / "artifacts", drop_from=STAGE_OF_POINT.get(point))

    killed = run_cli(setup, store, artifacts, kill_at=point)
    assert killed.returncode == -signal.SIGKILL, (
        f"the run was not killed at {point} (exit {killed.returncode}):\n{killed.stderr[-3000:]}")

    again = _assert_next_run_completes(setup, store, artifacts, tmp_path)
    champion = again["candidates"][0]["model_version"]
    sent = deliveries(setup.receiver)
    assert len(sent) == 1, f"{len(sent)} distinct deliveries for one promotion: {list(sent)}"
    (copies,) = sent.values()
    assert {(e["registered_model"], e["version"]) for e in copies} == {(MODEL, champion)}
    assert len(copies) == (2 if point == "notify.sent" else 1), "only a lost answer repeats a delivery"
    assert again["events_pending"] == []


@pytest.mark.parametrize("point", ON_TEMPORARY_SERVERS)
def test_a_run_killed_holding_a_slot_of_its_temporary_server_is_completed_by_the_next_without_loss(
        point: str, cli_setup_own_server: CliSetup, tmp_path: Path) -> None:
    _killed_then_completed(cli_setup_own_server, point, tmp_path)


def _run_in_terminal(setup: CliSetup, artifacts: Path, env: dict[str, str]) -> tuple[int, int, str]:
    """Start `smelter run` as a terminal's foreground job; returns (pid, the terminal's fd, ""): read with _read."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: a session leader whose controlling terminal is the pty
        try:
            os.chdir(REPO)
            os.execve(sys.executable, [sys.executable, "-m", "flows.cli", "run", "-f", str(setup.pipelines),
                                       "--artifacts", str(artifacts)], env)
        finally:
            os._exit(127)
    return pid, fd, ""


def _read(fd: int, seconds: float) -> str:
    out = b""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], max(0.0, min(0.5, deadline - time.monotonic())))
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                break
            if not chunk:
                break
            out += chunk
    return out.decode(errors="replace")


def _close_terminal(pid: int, fd: int, code: int | None) -> None:
    """The run in the terminal killed and reaped unless it exited (`code`), then the terminal closed."""
    if code is None:  # not reaped yet: still running, or ended before the point
        with contextlib.suppress(ChildProcessError, ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    os.close(fd)


def _wait_exit(pid: int, fd: int, seconds: float) -> tuple[int | None, str]:
    """The exit code (None if still running after `seconds`) and what the terminal showed meanwhile."""
    shown = ""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        shown += _read(fd, 0.5)
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status), shown + _read(fd, 0.5)
    return None, shown


@pytest.mark.parametrize("point", ["export", "calibration", "build", "benchmark", "version.created"])
def test_ctrl_c_in_a_terminal_stops_the_run_cleanly_and_the_next_completes(
        point: str, cli_setup_own_server: CliSetup, tmp_path: Path) -> None:
    """Ctrl-C typed in a terminal goes to the whole foreground process group: smelter says one line and exits
    130 promptly, with no traceback; the temporary Prefect server (a group of its own) outlives it long enough
    for the slots to be given back; then a run completes."""
    setup = cli_setup_own_server
    setup.receiver.events.clear()
    store = empty_store(setup, tmp_path / "store")
    artifacts = copy_artifacts(setup, tmp_path / "artifacts", drop_from=STAGE_OF_POINT.get(point))
    paused = tmp_path / "paused"
    env = setup.env | {"MLFLOW_TRACKING_URI": store, "SMELTER_KILL_AT": point, "SMELTER_KILL_SIGNAL": "PAUSE",
                       "SMELTER_PAUSE_FILE": str(paused), "TERM": "xterm"}
    pid, fd, shown = _run_in_terminal(setup, artifacts, env)
    code = None
    try:
        deadline = time.monotonic() + 240
        while not paused.exists() and time.monotonic() < deadline:
            shown += _read(fd, 0.5)
            assert os.waitpid(pid, os.WNOHANG)[0] == 0, f"the run ended before {point}:\n{shown[-3000:]}"
        assert paused.exists(), f"the run never reached {point}:\n{shown[-3000:]}"
        os.write(fd, b"\x03")  # the terminal turns it into SIGINT for its foreground process group
        code, after = _wait_exit(pid, fd, CTRL_C_WITHIN_S)
    finally:
        _close_terminal(pid, fd, code)
    assert code == 130, f"exit {code} after Ctrl-C at {point}:\n{(shown + after)[-3000:]}"
    assert after.count("interrupted (Ctrl-C)") == 1 and "Traceback" not in after, after[-3000:]
    assert "Exception ignored" not in after and "KeyboardInterrupt" not in after, after[-3000:]
    assert not list((artifacts / PIPELINE).glob("*/.*.*")), "a stage's temp dir outlived the stopped run"
    assert "RUNNING" not in run_statuses(store).values()

    _assert_next_run_completes(setup, store, artifacts, tmp_path)


@pytest.mark.parametrize("after_s", [0.5, 1.2, 2.5])
def test_ctrl_c_pressed_twice_as_a_run_starts_ends_it_as_once(
        after_s: float, cli_setup_own_server: CliSetup, tmp_path: Path) -> None:
    """Ctrl-C pressed twice (or once through `timeout`, which passes it on) while the run starts: the second,
    arriving while the first one's cleanup runs, changes nothing: one line, exit 130, no traceback."""
    setup = cli_setup_own_server
    store = empty_store(setup, tmp_path / "store")
    artifacts = copy_artifacts(setup, tmp_path / "artifacts", drop_from=None)
    pid, fd, shown = _run_in_terminal(setup, artifacts, setup.env | {"MLFLOW_TRACKING_URI": store, "TERM": "xterm"})
    code = None
    try:
        shown += _read(fd, after_s)
        os.write(fd, b"\x03")
        shown += _read(fd, 0.1)
        os.write(fd, b"\x03")
        code, after = _wait_exit(pid, fd, CTRL_C_WITHIN_S)
    finally:
        _close_terminal(pid, fd, code)
    said = shown + after
    assert code == 130, f"exit {code} after two Ctrl-C at {after_s} s:\n{said[-3000:]}"
    assert said.count("interrupted (Ctrl-C)") == 1 and "Traceback" not in said, said[-3000:]
    assert "Exception ignored" not in said and "KeyboardInterrupt" not in said, said[-3000:]


@pytest.mark.parametrize(("point", "name", "code", "said"), [
    ("accuracy", "INT", 130, "interrupted (Ctrl-C)"),
    ("accuracy", "TERM", 143, "terminated (SIGTERM)"),
    ("version.created", "INT", 130, "interrupted (Ctrl-C)"),
])
def test_a_run_stopped_by_sigint_or_sigterm_ends_cleanly_and_the_next_completes(
        point: str, name: str, code: int, said: str, cli_setup_own_server: CliSetup, tmp_path: Path) -> None:
    """SIGINT or SIGTERM to smelter alone: one line saying so (no traceback), the shell's exit code, the
    unfinished stage's temp dir gone, no MLflow run left RUNNING (the pipeline's run is KILLED); then a run
    completes."""
    setup = cli_setup_own_server
    setup.receiver.events.clear()
    store = empty_store(setup, tmp_path / "store")
    artifacts = copy_artifacts(setup, tmp_path / "artifacts", drop_from=STAGE_OF_POINT.get(point))

    stopped = run_cli(setup, store, artifacts, kill_at=point, extra_env={"SMELTER_KILL_SIGNAL": name})
    assert stopped.returncode == code, f"exit {stopped.returncode}:\n{stopped.stderr[-3000:]}"
    assert said in stopped.stderr and "Traceback" not in stopped.stderr, stopped.stderr[-3000:]
    assert len(stopped.stderr) < 2000, stopped.stderr[-3000:]
    assert not list((artifacts / PIPELINE).glob("*/.*.*")), "a stage's temp dir outlived the stopped run"
    statuses = run_statuses(store)
    assert "RUNNING" not in statuses.values() and "KILLED" in statuses.values(), statuses

    _assert_next_run_completes(setup, store, artifacts, tmp_path)
    assert len(deliveries(setup.receiver)) == 1


# The module's lasting server is started by its first test here, after the temporary servers' tests: it idles
# for no other test of the module (about 2 s of CPU a minute)
@pytest.mark.parametrize("point", ON_A_LASTING_SERVER)
def test_a_run_killed_at_any_other_point_is_completed_by_the_next_without_loss(
        point: str, cli_setup: CliSetup, tmp_path: Path) -> None:
    _killed_then_completed(cli_setup, point, tmp_path)


def test_a_worker_killed_mid_build_frees_its_slot_on_a_lasting_server(cli_setup: CliSetup, tmp_path: Path) -> None:
    """Against a lasting `prefect server`, a run killed while it holds a build slot: the next run on this host
    finds the holder dead and takes the slot over at once (the server itself would expire it a lease later)."""
    store = empty_store(cli_setup, tmp_path / "store")
    artifacts = copy_artifacts(cli_setup, tmp_path / "artifacts", drop_from="build")
    killed = run_cli(cli_setup, store, artifacts, kill_at="build")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]

    result = run_cli(cli_setup, store, artifacts)
    summary(result)
    assert "taken over" in result.stderr and "waiting, held by" not in result.stderr, result.stderr[-3000:]
    import httpx

    limits = httpx.post(f"{cli_setup.prefect_api}/v2/concurrency_limits/filter", json={}, timeout=10).json()
    assert {limit["name"]: limit["active_slots"] for limit in limits if limit["active_slots"]} == {}
