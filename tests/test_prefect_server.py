"""The temporary Prefect server a run starts for itself: ready when the flow needs it, gone when the run ends.

It starts before the run's own checks so its startup overlaps them; so a run refused by a later check
must stop it too. Each case runs in its own process with no PREFECT_API_URL, as `smelter run` does.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from tests.fixtures.cli_runs import prefect_server_processes

REPO = Path(__file__).resolve().parents[1]
SERVING = """\
import httpx
from prefect.settings import get_current_settings
from flows.prefect_server import owned_server

with owned_server() as server:
    with server.serving() as url:
        settings = get_current_settings()
        assert settings.api.url == url, (settings.api.url, url)
        assert httpx.get(url + "/health").status_code == 200
        print("heartbeats", settings.flows.heartbeat_frequency)
    running_in_block = server.process.poll() is None
print("stopped", running_in_block and server.process.poll() is not None)
"""


def _env(prefect_home: Path, **extra: str) -> dict[str, str]:
    return os.environ | {"PREFECT_HOME": str(prefect_home), "PREFECT_API_URL": "", "PYTHONPATH": str(REPO),
                         "PREFECT_SERVER_ANALYTICS_ENABLED": "false"} | extra


def _gone(prefect_home: Path, within_s: float = 10) -> bool:
    deadline = time.monotonic() + within_s
    while prefect_server_processes(prefect_home) and time.monotonic() < deadline:
        time.sleep(0.2)
    return not prefect_server_processes(prefect_home)


def test_the_server_answers_when_served_and_stops_with_the_block(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", SERVING], env=_env(tmp_path), capture_output=True, text=True,
                          timeout=180, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "heartbeats None" in done.stdout, "a server that dies with the run needs no flow-run heartbeats"
    assert "stopped True" in done.stdout, "the server must stop when its block ends, not when the process exits"
    assert _gone(tmp_path), "the server outlived its block"


def test_a_run_refused_after_its_server_started_leaves_no_server(tmp_path: Path) -> None:
    """The tracking store is checked while the server starts; refusing the run stops the server."""
    not_a_database = tmp_path / "mlflow.db"
    not_a_database.write_bytes(b"no SQLite here\n" * 100)
    done = subprocess.run([sys.executable, "-m", "flows.cli", "run", "-f", str(REPO / "pipelines.yaml"),
                           "--pipeline", "minilm", "--artifacts", str(tmp_path / "artifacts")],
                          env=_env(tmp_path / "home", MLFLOW_TRACKING_URI=f"sqlite:///{not_a_database}"),
                          capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "MLflow cannot open this store" in done.stderr and "Traceback" not in done.stderr
    assert (tmp_path / "home").is_dir(), "the server was started before the check"
    assert _gone(tmp_path / "home")
    assert not_a_database.read_bytes() == b"no SQLite here\n" * 100
