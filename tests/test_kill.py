"""`smelter run` killed for real (SIGKILL) at every point that matters, then run again.

After each kill the next run completes; no partial or corrupt artifact is used; the alias points
at an existing, passing version whose registered files match their manifest; no MLflow run stays
RUNNING; and the promotion reaches the webhook receiver exactly once (a repeat after a lost answer
carries the same delivery id, which is how a receiver drops it).
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from tasks.killpoints import POINTS
from tests.fixtures.cli_runs import (MODEL, PIPELINE, CliSetup, assert_artifacts_intact, assert_registry_sound,
                                     cli_setup, copy_artifacts, deliveries, fresh_store, prefect_server_processes,
                                     run_cli, run_statuses, summary)

pytestmark = pytest.mark.slow
__all__ = ["cli_setup"]  # the module-scoped fixture these tests share

STAGE_OF_POINT = {"export": "export", "calibration": "precision", "build": "build", "accuracy": "accuracy",
                  "benchmark": "benchmark"}


@pytest.mark.parametrize("point", POINTS)
def test_a_run_killed_at_any_point_is_completed_by_the_next_without_loss(
        point: str, cli_setup: CliSetup, tmp_path: Path) -> None:
    receiver = cli_setup.receiver
    receiver.events.clear()
    store = fresh_store(tmp_path / "store")
    artifacts = copy_artifacts(cli_setup, tmp_path / "artifacts", drop_from=STAGE_OF_POINT.get(point))

    killed = run_cli(cli_setup, store, artifacts, kill_at=point)
    assert killed.returncode == -signal.SIGKILL, (
        f"the run was not killed at {point} (exit {killed.returncode}):\n{killed.stderr[-3000:]}")

    again = summary(run_cli(cli_setup, store, artifacts))
    (candidate,) = again["candidates"]
    assert candidate["status"] in ("promoted", "passed") and candidate["decision"]["holds_alias"], candidate
    assert_artifacts_intact(artifacts)
    champion = assert_registry_sound(store, tmp_path)
    assert candidate["model_version"] == champion

    sent = deliveries(receiver)
    assert len(sent) == 1, f"{len(sent)} distinct deliveries for one promotion: {list(sent)}"
    (copies,) = sent.values()
    assert {(e["registered_model"], e["version"]) for e in copies} == {(MODEL, champion)}
    assert len(copies) == (2 if point == "notify.sent" else 1), "only a lost answer repeats a delivery"
    assert again["events_pending"] == []


@pytest.mark.parametrize(("point", "name", "code", "said"), [
    ("accuracy", "INT", 130, "interrupted (Ctrl-C)"),
    ("accuracy", "TERM", 143, "terminated (SIGTERM)"),
    ("version.created", "INT", 130, "interrupted (Ctrl-C)"),
])
def test_a_run_stopped_by_ctrl_c_or_sigterm_ends_cleanly_and_the_next_completes(
        point: str, name: str, code: int, said: str, cli_setup: CliSetup, tmp_path: Path) -> None:
    """Ctrl-C or SIGTERM: one line saying so (no traceback), the shell's exit code, the unfinished stage's
    temp dir gone, no MLflow run left RUNNING (the pipeline's run is KILLED); then a run completes."""
    cli_setup.receiver.events.clear()
    store = fresh_store(tmp_path / "store")
    artifacts = copy_artifacts(cli_setup, tmp_path / "artifacts", drop_from=STAGE_OF_POINT.get(point))

    stopped = run_cli(cli_setup, store, artifacts, kill_at=point, extra_env={"SMELTER_KILL_SIGNAL": name})
    assert stopped.returncode == code, f"exit {stopped.returncode}:\n{stopped.stderr[-3000:]}"
    assert said in stopped.stderr and "Traceback" not in stopped.stderr, stopped.stderr[-3000:]
    assert len(stopped.stderr) < 2000, stopped.stderr[-3000:]
    assert not list((artifacts / PIPELINE).glob("*/.*.*")), "a stage's temp dir outlived the stopped run"
    statuses = run_statuses(store)
    assert "RUNNING" not in statuses.values() and "KILLED" in statuses.values(), statuses

    again = summary(run_cli(cli_setup, store, artifacts))
    (candidate,) = again["candidates"]
    assert candidate["status"] in ("promoted", "passed") and candidate["decision"]["holds_alias"], candidate
    assert_artifacts_intact(artifacts)
    assert candidate["model_version"] == assert_registry_sound(store, tmp_path)
    assert len(deliveries(cli_setup.receiver)) == 1


def test_the_temporary_prefect_server_dies_with_a_killed_run(cli_setup: CliSetup, tmp_path: Path) -> None:
    """Without PREFECT_API_URL the CLI starts its own server; a SIGKILLed run must not leave it running."""
    home = tmp_path / "prefect-home"
    home.mkdir()
    env = {"PREFECT_HOME": str(home), "PREFECT_API_URL": ""}
    killed = run_cli(cli_setup, fresh_store(tmp_path / "store"), copy_artifacts(cli_setup, tmp_path / "a"),
                     kill_at="run.started", extra_env=env)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    deadline = time.monotonic() + 10
    while prefect_server_processes(home) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert prefect_server_processes(home) == [], "the run's temporary Prefect server outlived it"
