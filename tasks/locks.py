"""Locks that hold across processes and never outlive their holder.

`file_lock` is an flock: it covers the processes of one host, and the kernel releases it when its
holder dies. `held_slot` is one slot of a Prefect global concurrency limit, which covers every run
sharing the Prefect server (other hosts too). A Prefect slot alone can outlive its holder: the
temporary server keeps its leases in memory and dies with the run that started it, so a run
killed while holding a slot leaves it taken in the database for good. So each slot taken here is
recorded with its holder (host, pid, process start, lease, since when, what for) beside the
database it describes, and a waiter acts on that record:

- holder dead on this host: the waiter releases its lease and takes the slot over at once;
- slot taken with no record, on a temporary server (whose clients are all on this host and all
  record what they take, under the same lock as the take): the slot is an orphan, freed at once;
- holder on another host (a lasting server): the waiter waits for the holder's Prefect lease,
  which a live holder renews and the server's lease service expires `LEASE_S` after a death.

A waiter says what it waits for after `SAY_AFTER_S`, and again, naming the blocked stage and
run, after `BLOCKED_AFTER_S`.
"""

from __future__ import annotations

import contextlib
import contextvars
import fcntl
import hashlib
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from uuid import UUID

from tasks.holder import Holder
from tasks.scratch import system_temp_dir
from tasks.whole_file import write_whole

LOCK_DIR_ENV = "SMELTER_LOCK_DIR"
LEASE_S = 60  # the least Prefect accepts: a holder killed on another host blocks others this long
SAY_AFTER_S = 10
BLOCKED_AFTER_S = 60
POLL_S = 1.0
BUSY_RETRIES, BUSY_RETRY_FIRST_S, BUSY_RETRY_MAX_S = 8, 0.02, 0.5  # a 503 of a busy SQLite database: ~1.5 s in all
RECORDS_DIR = "smelter-slots"

log = logging.getLogger("smelter.locks")
_report: Callable[[str], None] = log.warning
_temporary_home: Path | None = None  # PREFECT_HOME of the temporary server this process runs, if any


def report_waits_to(report: Callable[[str], None]) -> None:
    """Where a waiter's notices go (the terminal and the Prefect run log, from the flows)."""
    global _report
    _report = report


@contextlib.contextmanager
def temporary_server(prefect_home: Path) -> Iterator[None]:
    """Meanwhile the Prefect API is a temporary server on `prefect_home`'s database: every client of it
    is on this host, and slot records live beside that database (they describe it, whatever its URL)."""
    global _temporary_home
    previous, _temporary_home = _temporary_home, prefect_home
    try:
        yield
    finally:
        _temporary_home = previous


def _lock_dir() -> Path:
    return Path(os.environ.get(LOCK_DIR_ENV) or system_temp_dir() / "smelter-locks")


_held: dict[str, tuple[int, int]] = {}
_held_lock = threading.Lock()


@contextlib.contextmanager
def file_lock(path: Path, *, reentrant: bool = False, what: str | None = None) -> Iterator[None]:
    """Hold an exclusive flock on `path` (created if missing); blocks until it is free.

    The holder writes who it is into the file, so that a waiter for `what` can say, after
    `SAY_AFTER_S`, who it waits for. `reentrant`: a second holder in this process goes through (a
    repair inside a build holds its key's lock already); otherwise a process's threads exclude each
    other as other processes do.
    """
    name = str(path)
    if reentrant:
        with _held_lock:
            fd, depth = _held.get(name, (-1, 0))
            if depth:
                _held[name] = (fd, depth + 1)
        if depth:
            try:
                yield
            finally:
                _leave(name)
            return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(name, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        _flock(fd, what)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"holder": Holder.current().to_dict(), "since": time.time()}).encode(), 0)
    except BaseException:
        os.close(fd)
        raise
    if not reentrant:
        try:
            yield
        finally:
            os.close(fd)  # closing releases the lock
        return
    with _held_lock:
        _held[name] = (fd, 1)
    try:
        yield
    finally:
        _leave(name)


def _flock(fd: int, what: str | None) -> None:
    """Take the flock; while another process has it, say after SAY_AFTER_S who (when `what` names it)."""
    if what is None:
        fcntl.flock(fd, fcntl.LOCK_EX)
        return
    started = time.monotonic()
    said = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        if not said and time.monotonic() - started >= SAY_AFTER_S:
            _report(f"warning: {what}: waiting, held by {_lock_holder(fd)} on this host{_blocked_here()}")
            said = True
        time.sleep(0.2)


def _lock_holder(fd: int) -> str:
    try:
        data = json.loads(os.pread(fd, 4096, 0))
        since = datetime.fromtimestamp(float(data["since"]), timezone.utc).strftime("%H:%M:%S UTC")
        return f"{Holder.from_dict(data['holder']).describe()} since {since}"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process"


def _leave(name: str) -> None:
    with _held_lock:
        fd, depth = _held[name]
        if depth > 1:
            _held[name] = (fd, depth - 1)
            return
        del _held[name]
    os.close(fd)


def _slug(scope: str, name: str) -> str:
    digest = hashlib.sha256(f"{scope}\0{name}".encode()).hexdigest()[:16]
    return f"{re.sub(r'[^A-Za-z0-9_.-]+', '-', name)[:80]}-{digest}"


def _prefect_reachable() -> bool:
    from prefect.context import FlowRunContext
    from prefect.settings import PREFECT_API_URL

    return FlowRunContext.get() is not None or bool(PREFECT_API_URL.value())


@dataclass(frozen=True)
class SlotRecord:
    """Who holds a slot: written by the holder under the record's lock, in the same step as the take."""

    lease_id: UUID
    holder: Holder
    since: float
    doing: str

    def to_json(self) -> str:
        return json.dumps({"lease_id": str(self.lease_id), "holder": self.holder.to_dict(), "since": self.since,
                           "doing": self.doing})

    @classmethod
    def read(cls, path: Path) -> SlotRecord | None:
        try:
            data = json.loads(path.read_text())
            return cls(UUID(data["lease_id"]), Holder.from_dict(data["holder"]), float(data["since"]),
                       str(data.get("doing", "")))
        except (OSError, ValueError, KeyError, TypeError):
            return None  # none, or torn by a crash mid-write: as good as none

    def describe(self) -> str:
        since = datetime.fromtimestamp(self.since, timezone.utc).strftime("%H:%M:%S UTC")
        return f"{self.holder.describe()} since {since}" + (f" ({self.doing})" if self.doing else "")


def _records_dir() -> tuple[Path, bool]:
    """Where this server's slot records live, and whether it is a temporary server."""
    if _temporary_home is not None:
        return _temporary_home / RECORDS_DIR, True
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value() or ""
    return _lock_dir() / RECORDS_DIR / hashlib.sha256(url.encode()).hexdigest()[:12], False


def _doing() -> str:
    """What this process holds a slot for: its Prefect task and flow run, when there is one."""
    from prefect.context import FlowRunContext, TaskRunContext

    parts = []
    task_run = TaskRunContext.get()
    if task_run is not None:
        parts.append(f"task {task_run.task_run.name}")
    flow_run = FlowRunContext.get()
    if flow_run is not None and flow_run.flow_run is not None:
        parts.append(f"flow run {flow_run.flow_run.name}")
    return ", ".join(parts)


def _ensure_limit(client: Any, name: str) -> None:
    """Prefect skips a missing limit with a warning rather than creating it: create it with one slot."""
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    try:
        client.read_global_concurrency_limit_by_name(name)
    except ObjectNotFound:
        with contextlib.suppress(ObjectAlreadyExists):  # another run created it meanwhile
            client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))


def _try_take(client: Any, name: str) -> UUID | None:
    """The lease of a slot just taken, or None when the limit is full (Prefect answers 423)."""
    import httpx

    try:
        response = _post_soon_retried(client, "/v2/concurrency_limits/increment-with-lease",
                                      {"names": [name], "slots": 1, "mode": "concurrency", "lease_duration": LEASE_S})
    except httpx.HTTPStatusError as e:
        if e.response.status_code != 423:
            raise
        return None
    return UUID(response.json()["lease_id"])


def _post_soon_retried(client: Any, path: str, body: dict[str, Any]) -> Any:
    """POST to the Prefect API, asked again within milliseconds while the server answers 503.

    A Prefect server on SQLite answers 503 when another request holds the database's write lock (a run's
    flow and task states, logs and events are written meanwhile); Prefect's client then sleeps ~2 s before
    each retry, and once more after its last, which happened on most slots a run took. So the request goes
    through the client's own httpx client (its base URL and auth headers) without that loop; a server that
    still answers 503, or 403 (CSRF protection, which Prefect's loop handles), or a dropped connection, gets
    Prefect's way after.
    """
    import httpx

    http = client._client  # Prefect's httpx client; its `send` is the retry loop
    delay, response = BUSY_RETRY_FIRST_S, None
    for _ in range(BUSY_RETRIES):
        try:
            response = httpx.Client.send(http, http.build_request("POST", path, json=body))
        except httpx.TransportError:  # a dropped connection: Prefect's loop knows which to retry
            response = None
            break
        if response.status_code != 503:
            break
        time.sleep(delay)
        delay = min(2 * delay, BUSY_RETRY_MAX_S)
    if response is None or response.status_code in (403, 503):
        response = http.send(http.build_request("POST", path, json=body))
    response.raise_for_status()
    return response


@dataclass(frozen=True)
class _Try:
    """One try at a slot: the lease taken (or None), who held it, and whether this try freed it from them."""

    lease_id: UUID | None = None
    holder: str = ""
    freed: bool = False


def _take_or_free(client: Any, name: str, record_path: Path, temporary: bool) -> _Try:
    """One try, under the record's lock: take the slot (and record it), freeing it first from a dead holder."""
    with file_lock(record_path.with_suffix(".lock")):
        lease_id = _try_take(client, name)
        if lease_id is None:
            record = SlotRecord.read(record_path)
            if record is not None and record.holder.gone():
                freed_from = f"{record.describe()}, which is gone"
                client.release_concurrency_slots_with_lease(record.lease_id)
                record_path.unlink(missing_ok=True)
            elif record is None and temporary:
                # Every client of a temporary server records what it takes in the step that takes it: an
                # unrecorded slot was left by a process killed with its server.
                freed_from = "a run killed with its temporary server"
            else:
                return _Try(holder=record.describe() if record else
                            f"a process on another host (its lease ends {LEASE_S} s after its last renewal)")
            lease_id = _try_take(client, name)
            if lease_id is None and temporary:
                # The lease died with the server that granted it, so releasing it did nothing: the slot
                # is counted in the database alone, and only this host's runs use that database.
                client.release_concurrency_slots([name], 1, 1.0)
                lease_id = _try_take(client, name)
            if lease_id is None:
                return _Try(holder=freed_from, freed=True)  # another waiter got it first
        else:
            freed_from = ""
        _write(record_path, SlotRecord(lease_id, Holder.current(), time.time(), _doing()))
        return _Try(lease_id, holder=freed_from, freed=bool(freed_from))


def _write(path: Path, record: SlotRecord) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_whole(path, record.to_json())


class SlotBusy(Exception):
    """A slot asked for without waiting is held by a live holder."""


def _acquire(client: Any, name: str, what: str, record_path: Path, temporary: bool, wait: bool) -> UUID:
    """Wait for the slot (unless not `wait`: then SlotBusy), freeing it from a dead holder at once; say who
    holds it while waiting."""
    started = time.monotonic()
    said = 0
    while True:
        attempt = _take_or_free(client, name, record_path, temporary)
        if attempt.freed:
            _report(f"warning: {what}: was held by {attempt.holder}; taken over")
        if attempt.lease_id is not None:
            if said:
                _report(f"warning: {what}: got it after {time.monotonic() - started:.0f} s")
            return attempt.lease_id
        if attempt.freed:
            continue
        if not wait:
            raise SlotBusy(f"{what}: held by {attempt.holder}")
        waited = time.monotonic() - started
        if said == 0 and waited >= SAY_AFTER_S:
            _report(f"warning: {what}: waiting, held by {attempt.holder}")
            said = 1
        elif said == 1 and waited >= BLOCKED_AFTER_S:
            _report(f"warning: {what}: blocked for {waited:.0f} s{_blocked_here()}; held by {attempt.holder}")
            said = 2
        time.sleep(POLL_S)


def _blocked_here() -> str:
    doing = _doing()
    return f" ({doing})" if doing else ""


def _renew(lease_id: UUID, stop: threading.Event) -> None:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        while not stop.wait(LEASE_S / 3):
            with contextlib.suppress(Exception):  # a missed renewal is retried; the lease outlives two misses
                client.renew_concurrency_lease(lease_id, LEASE_S)


def _release(client: Any, lease_id: UUID, record_path: Path) -> None:
    """Give the slot back, then drop its record. Unreachable server: the record stays, so whoever waits
    next finds this process gone and takes the slot over."""
    with file_lock(record_path.with_suffix(".lock")):
        try:
            _post_soon_retried(client, "/v2/concurrency_limits/decrement-with-lease", {"lease_id": str(lease_id)})
        except Exception as e:  # noqa: BLE001 - the body's own outcome matters more than the release's
            log.warning("could not give back a Prefect slot (%s: %s); the next waiter takes it over",
                        type(e).__name__, e)
            return
        record = SlotRecord.read(record_path)
        if record is not None and record.lease_id == lease_id:
            record_path.unlink(missing_ok=True)


@contextlib.contextmanager
def held_slot(name: str, what: str, *, wait: bool = True) -> Iterator[None]:
    """One slot of the global concurrency limit `name` (created with one slot when missing), renewed while
    held, recorded with its holder, and released at the end (the record too, once the server has it back).

    `what` says in a waiter's notices what is waited for. Not `wait`: SlotBusy at once when a live holder has it.
    """
    from prefect.client.orchestration import get_client

    directory, temporary = _records_dir()
    record_path = directory / f"{name}.json"
    with get_client(sync_client=True) as client:
        _ensure_limit(client, name)
        lease_id = _acquire(client, name, what, record_path, temporary, wait)
        stop = threading.Event()
        renewer = threading.Thread(target=contextvars.copy_context().run, args=(_renew, lease_id, stop), daemon=True)
        renewer.start()
        try:
            yield
        finally:
            stop.set()
            renewer.join()
            _release(client, lease_id, record_path)


@contextlib.contextmanager
def exclusive(what: str, scope: str) -> Iterator[None]:
    """Run the body alone among every process that asks for (`what`, `scope`): this host's, and other
    hosts' sharing the Prefect server. `scope` (e.g. the MLflow tracking URI) keeps unrelated stores apart."""
    slug = _slug(scope, what)
    with file_lock(_lock_dir() / f"{slug}.lock", what=what):
        if _prefect_reachable():
            with held_slot(f"smelter-{slug}", what):
                yield
        else:
            yield
