"""Prefect slots that never outlive their holder, against a real lasting `prefect server`.

A holder killed on this host: the next taker takes its slot over at once. A slot taken with no record
on a temporary server's database (a run killed with its server): freed at once. A live holder: the
waiter waits and says who holds it. A holder on another host: the server's lease service frees the
slot a lease after the holder stops renewing it.
"""

from __future__ import annotations

import contextvars
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tasks import locks
from tests.fixtures.fleet import REPO, project_env

HOLD = """
import sys, time
from tasks import locks
with locks.held_slot(sys.argv[1], "test slot"):
    print("held", flush=True)
    time.sleep(600)
"""


@pytest.fixture
def api(prefect_api_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    from prefect.settings import PREFECT_API_URL, temporary_settings

    monkeypatch.setenv(locks.LOCK_DIR_ENV, str(tmp_path / "locks"))
    with temporary_settings(updates={PREFECT_API_URL: prefect_api_server}):
        yield prefect_api_server


@pytest.fixture
def notices(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    said: list[str] = []
    monkeypatch.setattr(locks, "_report", said.append)
    return said


def _holder(api: str, name: str, tmp_path: Path) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-c", HOLD, name], cwd=REPO, stdout=subprocess.PIPE, text=True,
                               env=project_env(PREFECT_API_URL=api, **{locks.LOCK_DIR_ENV: str(tmp_path / "locks")}))
    assert process.stdout.readline().strip() == "held"
    return process


def _active(api: str, name: str) -> int:
    return httpx.get(f"{api}/v2/concurrency_limits/{name}", timeout=10).json()["active_slots"]


def _take_in_thread(name: str) -> tuple[threading.Thread, threading.Event]:
    got = threading.Event()

    def take() -> None:
        with locks.held_slot(name, "test slot"):
            got.set()

    thread = threading.Thread(target=contextvars.copy_context().run, args=(take,), daemon=True)  # same Prefect API
    thread.start()
    return thread, got


def test_a_slot_of_a_holder_killed_on_this_host_is_taken_over_at_once(api: str, tmp_path: Path,
                                                                       notices: list[str]) -> None:
    name = f"test-{uuid.uuid4().hex[:8]}"
    holder = _holder(api, name, tmp_path)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert _active(api, name) == 1, "the killed holder's slot should still be taken"

    with locks.held_slot(name, "test slot"):
        assert _active(api, name) == 1
    assert _active(api, name) == 0
    assert len(notices) == 1 and f"pid {holder.pid}" in notices[0] and "which is gone; taken over" in notices[0]


def test_a_slot_with_no_holder_recorded_on_a_temporary_servers_database_is_freed(api: str, tmp_path: Path,
                                                                                   notices: list[str]) -> None:
    """Every client of a temporary server records its slot in the step that takes it: one taken without a
    record is a run's that died with its server."""
    from prefect.client.orchestration import get_client

    name = f"test-{uuid.uuid4().hex[:8]}"
    with locks.temporary_server(tmp_path / "home"):
        with locks.held_slot(name, "test slot"):
            pass
        with get_client(sync_client=True) as client:  # a take whose taker died before recording it
            client.increment_concurrency_slots_with_lease([name], 1, "concurrency", locks.LEASE_S)
        with locks.held_slot(name, "test slot"):
            assert _active(api, name) == 1
    assert _active(api, name) == 0
    assert any("killed with its temporary server" in n for n in notices), notices


def test_a_waiter_says_who_holds_the_slot_and_gets_it_when_the_holder_ends(
        api: str, tmp_path: Path, notices: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(locks, "SAY_AFTER_S", 0.5)
    name = f"test-{uuid.uuid4().hex[:8]}"
    holder = _holder(api, name, tmp_path)
    thread, got = _take_in_thread(name)
    deadline = time.monotonic() + 30
    while not notices and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not got.is_set(), "a live holder's slot was taken"
    assert notices and f"waiting, held by pid {holder.pid}" in notices[0] and "since" in notices[0], notices
    holder.terminate()  # dies without giving the slot back: still taken over, since it is this host's
    holder.wait()
    thread.join(timeout=60)
    assert got.is_set() and _active(api, name) == 0


@pytest.mark.slow
def test_a_slot_held_on_another_host_is_freed_by_the_servers_lease_expiry(api: str, tmp_path: Path,
                                                                          notices: list[str]) -> None:
    """A holder on another host cannot be checked from here: its slot frees when the lasting server's lease
    service expires its lease (60 s after its last renewal, checked every 15 s)."""
    name = f"test-{uuid.uuid4().hex[:8]}"
    holder = _holder(api, name, tmp_path)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    records = list((tmp_path / "locks").rglob(f"{name}.json"))
    assert len(records) == 1
    record = json.loads(records[0].read_text())
    record["holder"] |= {"host": "elsewhere", "machine": "0123456789"}  # as another host's process wrote it
    records[0].write_text(json.dumps(record))

    started = time.monotonic()
    with locks.held_slot(name, "test slot"):
        waited = time.monotonic() - started
    assert locks.LEASE_S - 10 < waited < locks.LEASE_S + 60, f"got the slot after {waited:.0f} s"
    assert any("elsewhere" in n for n in notices), notices


def test_no_lock_leaves_records_behind(api: str, tmp_path: Path) -> None:
    name = f"test-{uuid.uuid4().hex[:8]}"
    with locks.held_slot(name, "test slot"):
        assert list((tmp_path / "locks").rglob(f"{name}.json"))
    assert not list((tmp_path / "locks").rglob(f"{name}.json"))



def test_a_busy_database_answer_is_asked_again_within_milliseconds_and_other_answers_are_not() -> None:
    """A Prefect server on SQLite answers 503 while another request holds the write lock; Prefect's client would
    sleep ~2 s before retrying (and once more after its last try), on most slots a run takes. Against an HTTP
    server that answers 503 twice: the slot's request is asked again at once; a 423 (the limit is full) is not."""
    import http.server
    from types import SimpleNamespace

    answers: list[int] = []

    class Busy(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            self.rfile.read(int(self.headers["Content-Length"]))
            code = 423 if self.path.endswith("/full") else (503 if len(answers) < 2 else 200)
            answers.append(code)
            self.send_response(code)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Busy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{server.server_port}/api") as http_client:
            client = SimpleNamespace(_client=http_client)  # what locks reads of Prefect's client
            started = time.monotonic()
            assert locks._post_soon_retried(client, "/take", {"names": ["x"]}).status_code == 200
            assert time.monotonic() - started < 1.0 and answers == [503, 503, 200], answers
            answers.clear()
            with pytest.raises(httpx.HTTPStatusError) as raised:
                locks._post_soon_retried(client, "/full", {"names": ["x"]})
            assert raised.value.response.status_code == 423 and answers == [423]
    finally:
        server.shutdown()
