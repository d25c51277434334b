"""Prefect slots that never outlive their holder, against a real lasting `prefect server`.

A holder killed on this host: the next taker takes its slot over at once. A slot taken with no record
on a temporary server's database (a run killed with its server): freed at once. A live holder: the
waiter waits and says who holds it. A holder on another host: the server's lease service frees the
slot a lease after the holder stops renewing it. A record that cannot be read frees nothing; a holder cut
off from the server for longer than a lease writes nothing; promotions of two processes of one host exclude
each other whatever their $TMPDIR.
"""

from __future__ import annotations

import contextlib
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
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from tasks.runtime import locks
from tests.fixtures.fleet import REPO, project_env

HOLD = """
import contextlib, sys, time
from pathlib import Path
from tasks.runtime import locks
with locks.temporary_server(Path(sys.argv[2])) if len(sys.argv) > 2 else contextlib.nullcontext():
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


def _holder(api: str, name: str, tmp_path: Path, temporary_home: Path | None = None) -> subprocess.Popen:
    """A process holding slot `name` until killed (recorded as a temporary server's client under `temporary_home`)."""
    process = subprocess.Popen([sys.executable, "-c", HOLD, name, *([str(temporary_home)] if temporary_home else [])],
                               cwd=REPO, stdout=subprocess.PIPE, text=True,
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


def test_an_unreadable_record_is_reported_with_its_path_and_frees_no_slot(api: str, tmp_path: Path) -> None:
    """On a temporary server a slot with no record is an orphan, freed at once; one whose record exists but
    cannot be read belongs to a holder nobody can check, here a live one: it keeps its slot, and the waiter
    is told which file to look at."""
    name = f"test-{uuid.uuid4().hex[:8]}"
    home = tmp_path / "home"
    holder = _holder(api, name, tmp_path, temporary_home=home)
    try:
        record = home / locks.RECORDS_DIR / f"{name}.json"
        record.write_text('{"lease_id": "not a lease"')
        with locks.temporary_server(home), pytest.raises(locks.SlotBusy) as busy:
            with locks.held_slot(name, "test slot", wait=False):
                pytest.fail("the slot of a live holder was taken")
        assert str(record) in str(busy.value) and "cannot be read" in str(busy.value), busy.value
        assert _active(api, name) == 1 and holder.poll() is None
    finally:
        holder.kill()
        holder.wait()


PROMOTE = """
import sys
from tasks.runtime import locks, scratch
from tasks.judge import notify
scratch.activate()  # as every smelter command does: $TMPDIR becomes this process's own scratch dir
locks.SAY_AFTER_S = 0.5
with notify.promotion_lock(sys.argv[1]):
    print("held", flush=True)
    sys.stdin.readline()
"""


def _promoter(model: str, store: str, tmpdir: Path, api: str | None) -> subprocess.Popen:
    """A smelter process holding `model`'s promotion lock until told, with the host's default lock dir."""
    tmpdir.mkdir(parents=True, exist_ok=True)
    env = project_env(MLFLOW_TRACKING_URI=store, TMPDIR=str(tmpdir))
    for unset in (locks.LOCK_DIR_ENV, "PREFECT_API_URL"):
        env.pop(unset, None)
    if api:
        env["PREFECT_API_URL"] = api
    return subprocess.Popen([sys.executable, "-c", PROMOTE, model], cwd=REPO, env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _lines(stream: Any) -> list[str]:
    """The lines a child writes to `stream`, as they come (read in a thread, so the test never blocks on them)."""
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(line.strip() for line in stream), daemon=True).start()
    return lines


@pytest.mark.parametrize("prefect", ["one Prefect server", "different Prefect servers"])
def test_promotions_exclude_each_other_whatever_tmpdir_the_processes_have(prefect: str, api: str,
                                                                          tmp_path: Path) -> None:
    """A flow run that `smelter deploy` serves inherits the serving process's scratch dir as $TMPDIR; a run from a
    terminal has the system's. Against the same MLflow store, one waits for the other's promotion and names it,
    also when only the first reaches a Prefect server (so no Prefect slot stands between them); and no lock
    lands in a temp dir, which goes when its owner exits."""
    model, store = f"enc-{uuid.uuid4().hex[:8]}", f"sqlite:///{tmp_path / 'mlflow.db'}"
    served_dir = tmp_path / "smelter-tmp.served"  # a `smelter deploy` process's scratch dir, inherited
    served = _promoter(model, store, served_dir, api)
    terminal = None
    try:
        assert served.stdout.readline().strip() == "held", served.stderr.read()
        terminal = _promoter(model, store, tmp_path / "terminal-tmp", api if prefect == "one Prefect server" else None)
        said, got = _lines(terminal.stderr), _lines(terminal.stdout)
        deadline = time.monotonic() + 60
        while not any("waiting" in line for line in said) and not got and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not got, f"both held the promotion lock at once: {said}"
        assert any(f"waiting, held by pid {served.pid}" in line for line in said), said
        served.communicate("\n", timeout=60)
        deadline = time.monotonic() + 60
        while not got and time.monotonic() < deadline:
            time.sleep(0.2)
        assert got == ["held"], said
        terminal.stdin.write("\n")
        terminal.stdin.flush()
        assert terminal.wait(timeout=60) == 0
    finally:
        for process in (served, terminal):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()
        (locks.lock_dir() / f"{locks._slug(store, f'promote {model}')}.lock").unlink(missing_ok=True)
    assert not [p for p in served_dir.rglob("*") if p.suffix in (".lock", ".json")], "a lock or record in a temp dir"


class Link:
    """A TCP path to a server that can be cut and mended: a network partition between one client and a server
    that keeps running (and expiring that client's leases)."""

    def __init__(self, target_port: int):
        import socket

        self.target_port = target_port
        self.up = threading.Event()
        self.up.set()
        self._connections: list[socket.socket] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket

        while True:
            client, _ = self._listener.accept()
            if not self.up.is_set():
                client.close()
                continue
            server = socket.create_connection(("127.0.0.1", self.target_port))
            self._connections += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(source: object, sink: object) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        for end in (source, sink):
            with contextlib.suppress(OSError):
                end.close()

    def cut(self) -> None:
        self.up.clear()
        for connection in self._connections:
            with contextlib.suppress(OSError):
                connection.close()
        self._connections.clear()

    def mend(self) -> None:
        self.up.set()


BUILD = """
import sys
from pathlib import Path
from tasks.runtime import locks
from tasks.registry import tracking
from tasks.runtime.store import ArtifactStore
with locks.held_slot(sys.argv[1], "build of key k"):
    print("held", flush=True)
    sys.stdin.readline()
    try:
        with ArtifactStore(Path(sys.argv[2])).writing("p", "build", "k") as w:
            (w.dir / "engine.bin").write_text("first holder")
        print("wrote", flush=True)
    except locks.LeaseLost as e:
        print(f"stopped: {e}", flush=True)
    try:
        tracking.create_version("m", "run", {})
    except locks.LeaseLost as e:
        print(f"no registry write: {e}", flush=True)
"""


@pytest.mark.slow
@pytest.mark.waits
def test_a_holder_cut_off_from_a_lasting_server_for_a_lease_stops_before_writing(api: str, tmp_path: Path) -> None:
    """A build holds a key's slot; the network between it and the lasting Prefect server goes for longer than a
    lease. The server expires the lease and gives the slot to a waiter, which builds the key. The first holder,
    back on the network, must not publish the key nor write to the registry: it finds its lease gone and stops.
    Afterwards the store holds the second holder's build alone."""
    from tasks.runtime.store import ArtifactStore

    name = f"test-{uuid.uuid4().hex[:8]}"
    port = urlsplit(api).port
    link = Link(port)
    first = subprocess.Popen([sys.executable, "-c", BUILD, name, str(tmp_path / "store")], cwd=REPO, text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             env=project_env(PREFECT_API_URL=api.replace(f":{port}/", f":{link.port}/"),
                                             MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path / 'mlflow.db'}",
                                             **{locks.LOCK_DIR_ENV: str(tmp_path / "locks")}))
    try:
        assert first.stdout.readline().strip() == "held"
        link.cut()
        started = time.monotonic()
        with locks.held_slot(name, "build of key k"):  # the first holder lives: only its lease's expiry frees it
            waited = time.monotonic() - started
            with ArtifactStore(tmp_path / "store").writing("p", "build", "k") as w:
                (w.dir / "engine.bin").write_text("second holder")
            link.mend()
            out, _ = first.communicate("\n", timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert waited >= locks.LEASE_S - 5, f"the slot of a live holder was taken after {waited:.0f} s"
    assert "wrote" not in out.splitlines() and "stopped: build of key k: lost slot" in out, out
    assert "no registry write: build of key k: lost slot" in out, out
    found = ArtifactStore(tmp_path / "store").lookup("p", "build", "k")
    assert (found.path / "engine.bin").read_text() == "second holder"


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
@pytest.mark.waits
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
