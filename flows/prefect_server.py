"""A temporary Prefect server owned by this process: it dies with it, even when this process is killed.

With no PREFECT_API_URL, Prefect starts its own temporary server (a uvicorn subprocess) and stops
it at exit; a SIGKILL skips that and leaves the server running forever, parented to init. This one
is started the same way, but the kernel kills it when its parent dies (PR_SET_PDEATHSIG), and two
runs starting at once on a fresh Prefect database migrate it one at a time (a file lock). It runs
in a process group of its own: a terminal's Ctrl-C goes to the foreground group, smelter's, which
then stops in order (releasing its slots through this server) and stops the server last.

It is started before the run's own checks and imports and waited for only when the flow needs it:
its few seconds of startup, in its own process, overlap that work instead of following it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from tasks.runtime import quiet_neighbours
from tasks.runtime.server_health import unanswered

PR_SET_PDEATHSIG = 1
STARTUP_TIMEOUT_ENV = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"


def _die_with_parent() -> None:
    """Runs in the child between fork and exec: SIGKILL it when the parent thread goes away."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(port: int, log: object) -> subprocess.Popen:
    """Prefect's temporary server as Prefect starts it (its API only, in ephemeral mode), in the process
    flows/temporary_server.py makes."""
    from prefect.settings import get_current_settings

    env = os.environ | get_current_settings().to_environment_variables(exclude_unset=True) | {
        "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "flows.temporary_server", str(port)],
        env=env, preexec_fn=_die_with_parent, process_group=0, stdout=subprocess.DEVNULL, stderr=log)


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


def limit_prefect_retries(at_most: int) -> None:
    """Every Prefect API call of this process from now on waits out at most `at_most` retries (the settings
    object is the one every thread of the process reads), whatever PREFECT_CLIENT_MAX_RETRIES said."""
    from prefect.settings import get_current_settings

    with contextlib.suppress(Exception):  # a Prefect whose settings cannot be changed so: the calls just wait
        client = get_current_settings().client
        client.max_retries = min(client.max_retries, at_most)


def api_problem() -> str | None:
    """Why the Prefect API that PREFECT_API_URL names does not answer, or None (also when none is set:
    then `owned_server` starts one). Asked before any work: Prefect's client would retry for a while,
    then fail with a traceback from deep inside the flow engine."""
    from prefect.settings import PREFECT_API_URL

    from tasks.runtime.redact import redacted_url

    url = PREFECT_API_URL.value()
    why = unanswered(url) if url else None
    if why:
        return (f"PREFECT_API_URL {redacted_url(url)}: the Prefect server does not answer ({why}); "
                "start it (`prefect server start`), or unset the variable and smelter starts its own")
    return None


def api_lost() -> str | None:
    """The line that ends a run whose Prefect server stopped answering mid-run, or None (it answers).
    Asked after a failure, so a dead server is named once instead of each call's retries and traceback."""
    from prefect.settings import PREFECT_API_URL

    from tasks.runtime.redact import redacted_url

    if (line := temporary_server_lost()) is not None:
        return line
    url = PREFECT_API_URL.value()
    why = unanswered(url) if url else None
    if why:
        return (f"PREFECT_API_URL {redacted_url(url)}: the Prefect server stopped answering mid-run ({why}); "
                "finished stages are kept: start it again and run again "
                "(PREFECT_CLIENT_MAX_RETRIES lengthens the wait for a restart)")
    return None


_running: StartedServer | None = None  # the temporary server of this process, from its start to its stop


def temporary_server_lost() -> str | None:
    """The line that ends a run whose own temporary server died mid-run (killed, or out of memory), or
    None. Asked by the process itself, not through PREFECT_API_URL: the failure that asks may come as the
    flow ends, after the settings pointing at the server are gone."""
    server = _running
    if server is None or server.process.poll() is None:
        return None
    code = server.process.returncode
    try:
        how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
    except ValueError:
        how = f"killed by signal {-code}"
    return (f"smelter's temporary Prefect server (pid {server.process.pid}) stopped answering mid-run: {how}; "
            "finished stages are kept: run again (a lasting server: set PREFECT_API_URL)")


class StartedServer:
    """A temporary server starting in its own process; `serving()` waits until it answers.

    The start lock is taken before the process starts and released by a waiting thread as soon as
    the server answers, so a second run's server migrates the database after this one's, without
    waiting for this run's own checks. The process is started from the calling thread: the kernel
    kills it when that thread ends (PR_SET_PDEATHSIG), and the main thread lasts as long as the run.
    """

    def __init__(self, timeout_s: float):
        from prefect.settings import PREFECT_HOME

        from tasks.runtime.locks import file_lock

        self._log = tempfile.TemporaryFile()  # the server's stderr, read only when it fails to start
        self._start_lock = contextlib.ExitStack()
        self._start_lock.enter_context(file_lock(Path(PREFECT_HOME.value()) / "smelter-server-start.lock"))
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}/api"
        try:
            self.process = _start(port, self._log)
        except BaseException:
            self._start_lock.close()
            self._log.close()
            raise
        quiet_neighbours.pausable(self.process)  # paused while engines are timed: it shares their cores
        self._failure: BaseException | None = None
        self._waiter = threading.Thread(target=self._wait, args=(timeout_s,), name="prefect-server-start",
                                        daemon=True)
        self._waiter.start()

    def _wait(self, timeout_s: float) -> None:
        try:
            _wait_healthy(self.process, self.url, timeout_s, self._log)
        except BaseException as e:  # noqa: BLE001 - raised in the main thread by serving()
            self._failure = e
        finally:
            self._start_lock.close()

    @contextlib.contextmanager
    def serving(self) -> Iterator[str]:
        """Wait until the server answers, point Prefect at it, and send what is queued for it at the end.

        Flow-run heartbeats are off: they tell a lasting server that a run's process died, and this
        server dies with it. (Prefect joins the heartbeat thread, which sleeps in 1 s steps, at the
        end of every flow and subflow: up to a second each.)
        """
        from prefect.settings import (PREFECT_API_URL, PREFECT_FLOWS_HEARTBEAT_FREQUENCY, PREFECT_HOME,
                                      temporary_settings)

        from tasks.runtime.locks import temporary_server

        self._waiter.join()
        if self._failure is not None:
            raise self._failure
        with temporary_settings(updates={PREFECT_API_URL: self.url, PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}), \
                temporary_server(Path(PREFECT_HOME.value())):
            try:
                yield self.url
            finally:
                if self.process.poll() is None:
                    _drain()
                else:
                    _drop_queued()

    def stop(self) -> None:
        quiet_neighbours.forget(self.process)
        _stop(self.process)
        self._waiter.join()
        self._log.close()


class ConfiguredServer:
    """PREFECT_API_URL names a server: nothing to start or wait for."""

    @contextlib.contextmanager
    def serving(self) -> Iterator[None]:
        yield None


@contextlib.contextmanager
def owned_server() -> Iterator[StartedServer | ConfiguredServer]:
    """Start a server that dies with this process (unless PREFECT_API_URL names one) and stop it at the end.
    Use `with owned_server() as server: ...; with server.serving(): <flows>`."""
    from prefect.settings import PREFECT_API_URL

    global _running
    if PREFECT_API_URL.value():
        yield ConfiguredServer()
        return
    server = _running = StartedServer(float(os.environ.get(STARTUP_TIMEOUT_ENV, "120")))
    try:
        yield server
    finally:
        server.stop()
        _running = None


def _drain() -> None:
    """Send the logs and events still queued for the server before it stops."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        with contextlib.suppress(Exception):
            worker.drain_all(timeout=10)


def _drop_queued() -> None:
    """The server is dead: the logs and events queued for it can never be sent. Drop them, so that neither
    the run's end nor Python's exit waits out each one's retries (and logs about it after the run's log
    file is closed)."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    with contextlib.suppress(Exception):  # Prefect's internals: a version without them just waits
        instances = {id(i): i for worker in (APILogWorker, EventsWorker) for i in list(worker._instances.values())}
        for instance in instances.values():
            with contextlib.suppress(queue.Empty):
                while True:
                    instance._queue.get_nowait()
                    instance._queue.task_done()
