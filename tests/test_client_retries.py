"""A run rides out a Prefect server that is busy for a few seconds.

A SQLite Prefect server that two runs write to at once answers some calls `503 Service Unavailable` at once
(a write that finds the database locked; Prefect's exception handler turns it into a retryable answer).
Each retry of the Prefect client is a fresh chance; with the retries smelter set before, a call that met 503
three times within ~6 s failed the whole run (seen in two concurrent runs on a 2-core machine)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.fixtures.fleet import project_env

BUSY_S = 10.0  # longer than the old retries' last attempt (2 + 4 s, +20% jitter), shorter than the third retry


class BusyThenReady:
    """A loopback server that answers every call as Prefect's server does while its database is locked
    (503, Prefect's body) for BUSY_S seconds from the first call, then 200."""

    def __init__(self) -> None:
        self.calls: list[tuple[float, int]] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                now = time.monotonic()
                since = now - owner.calls[0][0] if owner.calls else 0.0
                busy = since < BUSY_S
                code = 503 if busy else 200
                body = json.dumps({"exception_message": "Service Unavailable"} if busy else "ready").encode()
                owner.calls.append((now, code))
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.api_url = f"http://127.0.0.1:{self.server.server_address[1]}/api"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture()
def busy_server() -> Iterator[BusyThenReady]:
    server = BusyThenReady()
    try:
        yield server
    finally:
        server.server.shutdown()


# What a smelter process does before it talks to Prefect: its retry bounds, then a call through Prefect's client
CALL_AS_SMELTER = """
import flows.cli
flows.cli._bound_client_retries()
from prefect.client.orchestration import get_client
with get_client(sync_client=True) as client:
    print(client.hello().json())
"""


@pytest.mark.waits
def test_a_call_rides_out_ten_seconds_of_a_busy_prefect_server(busy_server: BusyThenReady) -> None:
    env = {k: v for k, v in project_env(PREFECT_API_URL=busy_server.api_url).items()
           if k != "PREFECT_CLIENT_MAX_RETRIES"}  # smelter's default, not a user's setting
    done = subprocess.run([sys.executable, "-c", CALL_AS_SMELTER], env=env, capture_output=True, text=True,
                          timeout=120, cwd=os.getcwd())
    assert done.returncode == 0, f"the call failed after {busy_server.calls}:\n{done.stderr[-3000:]}"
    assert done.stdout.strip() == "ready"
    assert [code for _, code in busy_server.calls][-1] == 200 and len(busy_server.calls) > 3, busy_server.calls


def test_a_users_retry_setting_is_kept(busy_server: BusyThenReady) -> None:
    env = project_env(PREFECT_API_URL=busy_server.api_url, PREFECT_CLIENT_MAX_RETRIES="0")
    done = subprocess.run([sys.executable, "-c", CALL_AS_SMELTER], env=env, capture_output=True, text=True,
                          timeout=120, cwd=os.getcwd())
    assert done.returncode != 0 and "503" in done.stderr
    assert [code for _, code in busy_server.calls] == [503]
