"""A temporary Prefect server owned by this process: it dies with it, even when this process is killed.

With no PREFECT_API_URL, Prefect starts its own temporary server (a uvicorn subprocess) and stops
it at exit; a SIGKILL skips that and leaves the server running forever, parented to init. This one
is started the same way, but the kernel kills it when its parent dies (PR_SET_PDEATHSIG), and two
runs starting at once on a fresh Prefect database migrate it one at a time (a file lock).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

PR_SET_PDEATHSIG = 1
STARTUP_TIMEOUT_ENV = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"
HEALTH_TIMEOUT_S = 5.0


def _die_with_parent() -> None:
    """Runs in the child between fork and exec: SIGKILL it when the parent thread goes away."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(port: int, log: object) -> subprocess.Popen:
    import prefect
    from prefect.settings import get_current_settings

    env = os.environ | get_current_settings().to_environment_variables(exclude_unset=True) | {
        "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "--app-dir", str(prefect.__module_path__.parent), "--factory",
         "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(port),
         "--log-level", "error", "--lifespan", "on"],
        env=env, preexec_fn=_die_with_parent, stdout=subprocess.DEVNULL, stderr=log)


def _wait_healthy(process: subprocess.Popen, url: str, timeout_s: float, log) -> None:
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=2) as client:  # one client: each new one loads the CA bundle, ~0.2 s of CPU
        while time.monotonic() < deadline:
            if process.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"the temporary Prefect server exited with {process.returncode}: "
                                   f"{log.read().decode(errors='replace')[-2000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if client.get(f"{url}/health").status_code == 200:
                    return
            time.sleep(0.2)
    raise RuntimeError(f"the temporary Prefect server did not answer {url}/health within {timeout_s:.0f} s")


def _stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def api_problem() -> str | None:
    """Why the Prefect API that PREFECT_API_URL names does not answer, or None (also when none is set:
    then `owned_server` starts one). Asked before any work: Prefect's client would retry for a while,
    then fail with a traceback from deep inside the flow engine."""
    from prefect.settings import PREFECT_API_URL

    from tasks.redact import redacted_url

    url = PREFECT_API_URL.value()
    if not url:
        return None
    try:
        httpx.get(f"{url.rstrip('/')}/health", timeout=HEALTH_TIMEOUT_S)
    except (httpx.HTTPError, httpx.InvalidURL) as e:
        return (f"PREFECT_API_URL {redacted_url(url)}: the Prefect server does not answer ({type(e).__name__}); "
                "start it (`prefect server start`), or unset the variable and smelter starts its own")
    return None


@contextlib.contextmanager
def owned_server() -> Iterator[str | None]:
    """Point Prefect at a server that dies with this process; yields its API URL (None when one is configured)."""
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME, temporary_settings

    from tasks.locks import file_lock

    if PREFECT_API_URL.value():
        yield None
        return
    timeout_s = float(os.environ.get(STARTUP_TIMEOUT_ENV, "120"))
    with tempfile.TemporaryFile() as log:  # the server's stderr, read only when it fails to start
        with file_lock(Path(PREFECT_HOME.value()) / "smelter-server-start.lock"):
            port = _free_port()
            process = _start(port, log)
            url = f"http://127.0.0.1:{port}/api"
            try:
                _wait_healthy(process, url, timeout_s, log)
            except BaseException:
                _stop(process)
                raise
        try:
            with temporary_settings(updates={PREFECT_API_URL: url}):
                try:
                    yield url
                finally:
                    _drain()
        finally:
            _stop(process)


def _drain() -> None:
    """Send the logs and events still queued for the server before it stops."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        with contextlib.suppress(Exception):
            worker.drain_all(timeout=10)
