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

A record that exists but cannot be read is a fault, reported with its path: it never frees a slot (only a
holder proven gone does). A holder whose renewals go unconfirmed (a server it cannot reach) may lose its
slot to a waiter elsewhere once its lease ends: `raise_if_lease_lost`, called before every store
publication and registry write, renews once more and raises LeaseLost when the server does not confirm it.

Every smelter process of a host finds the same lock dir (`lock_dir`), whatever its $TMPDIR or user.

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
import stat
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from uuid import UUID

from tasks.runtime.holder import Holder
from tasks.runtime.whole_file import write_whole

LOCK_DIR_ENV = "SMELTER_LOCK_DIR"
# The host's lock dir when LOCK_DIR_ENV is unset: the first whose parent is shared by every user of the host
# (world-writable and sticky, as /run/lock and /tmp are). Never $TMPDIR, which differs between users, units
# and the processes smelter starts (tasks/runtime/scratch.py points theirs at a dir removed when its owner exits).
HOST_LOCK_DIRS = (Path("/run/lock/smelter"), Path("/tmp/smelter-locks"))
LEASE_S = 60  # the least Prefect accepts: a holder killed on another host blocks others this long
RENEW_EVERY_S = LEASE_S / 3
RETRY_RENEWAL_S = 2.0  # after a renewal that failed
# A holder unconfirmed this long (two renewals missed) proves it still holds its slot before it writes: what is
# left of the lease then (20 s at least) covers the write, and the proof renews it for a whole lease.
REPROVE_AFTER_S = LEASE_S - RENEW_EVERY_S
REPROVE_TIMEOUT_S = 10.0  # a renewal asked for at a safe point: a server that does not answer by then is lost
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


def lock_dir() -> Path:
    """This host's lock dir: $SMELTER_LOCK_DIR, else the first of HOST_LOCK_DIRS whose parent every user shares."""
    configured = os.environ.get(LOCK_DIR_ENV)
    if configured:
        return Path(configured)
    return next((d for d in HOST_LOCK_DIRS if _shared_by_all(d.parent)), HOST_LOCK_DIRS[-1])


def _shared_by_all(directory: Path) -> bool:
    try:
        mode = directory.stat().st_mode
    except OSError:
        return False
    return stat.S_ISDIR(mode) and mode & 0o1777 == 0o1777


def _shared_dir(path: Path, mode: int) -> None:
    """Create `path` (and what is missing above it) so that every user of the host may use it: `mode`
    whatever the creator's umask. One made by another user is left as it is."""
    if path.is_dir():
        return
    _shared_dir(path.parent, mode)
    try:
        path.mkdir()
    except FileExistsError:
        return
    with contextlib.suppress(OSError):
        os.chmod(path, mode)


def _open_lock_file(name: str) -> int:
    """An fd of the lock file, created readable and writable by every user of the host when missing. An
    existing one is opened without O_CREAT: in a sticky dir, fs.protected_regular refuses O_CREAT on another
    user's file."""
    try:
        return os.open(name, os.O_RDWR)
    except FileNotFoundError:
        fd = os.open(name, os.O_RDWR | os.O_CREAT, 0o666)
        with contextlib.suppress(OSError):
            os.fchmod(fd, 0o666)
        return fd


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
    fd = _open_lock_file(name)
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


class UnreadableRecord(Exception):
    """A slot record that exists but cannot be read: its holder cannot be checked, so its slot stays taken."""

    def __init__(self, path: Path, why: str):
        super().__init__(f"slot record {path} cannot be read ({why}); its holder cannot be checked, so the "
                         f"slot stays taken: remove the file once no smelter process holds that slot")
        self.path = path


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
        """The record, or None when there is none. Records are written whole (tmp + rename), so one that
        exists but cannot be read is a fault: UnreadableRecord, never "no holder"."""
        try:
            data = json.loads(path.read_text())
            return cls(UUID(data["lease_id"]), Holder.from_dict(data["holder"]), float(data["since"]),
                       str(data.get("doing", "")))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise UnreadableRecord(path, f"{type(e).__name__}: {e}") from e

    def describe(self) -> str:
        since = datetime.fromtimestamp(self.since, timezone.utc).strftime("%H:%M:%S UTC")
        return f"{self.holder.describe()} since {since}" + (f" ({self.doing})" if self.doing else "")


def _records_dir() -> tuple[Path, bool]:
    """Where this server's slot records live, and whether it is a temporary server."""
    if _temporary_home is not None:
        return _temporary_home / RECORDS_DIR, True
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value() or ""
    return _host_lock_dir() / RECORDS_DIR / hashlib.sha256(url.encode()).hexdigest()[:12], False


def _host_lock_dir() -> Path:
    """`lock_dir()`, created sticky and writable by all (as /tmp): any user's process may add a lock, none
    may remove another's."""
    directory = lock_dir()
    _shared_dir(directory, 0o1777)
    return directory


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
            try:
                record = SlotRecord.read(record_path)
            except UnreadableRecord as e:
                return _Try(holder=f"a holder this process cannot check: {e}")
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
    """Whole, in a dir every user of the host may replace records in (not sticky: the next taker of a slot
    replaces its last holder's record)."""
    _shared_dir(path.parent, 0o777)
    write_whole(path, record.to_json())


class SlotBusy(Exception):
    """A slot asked for without waiting is held by a live holder."""


def _acquire(client: Any, name: str, what: str, record_path: Path, temporary: bool, wait: bool) -> _Lease:
    """Wait for the slot (unless not `wait`: then SlotBusy), freeing it from a dead holder at once; say who
    holds it while waiting."""
    started = time.monotonic()
    said = 0
    while True:
        asked_at = time.monotonic()
        attempt = _take_or_free(client, name, record_path, temporary)
        if attempt.freed:
            _report(f"warning: {what}: was held by {attempt.holder}; taken over")
        if attempt.lease_id is not None:
            if said:
                _report(f"warning: {what}: got it after {time.monotonic() - started:.0f} s")
            return _Lease(name, what, attempt.lease_id, asked_at)
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


class LeaseLost(RuntimeError):
    """A slot this process held may now be another's: its renewals went unconfirmed and one more failed (the
    server unreachable), or the server said the lease is gone. What the holder was doing stops before it writes."""


@dataclass
class _Lease:
    """A slot this process holds, and since when the server has surely kept it: the time a renewal (or the
    take) was *asked* for that the server confirmed; its lease runs LEASE_S from that request at the latest."""

    name: str
    what: str
    lease_id: UUID
    confirmed_at: float
    gone: str = ""  # why the server says the lease no longer exists

    def renew(self, client: Any, timeout: float) -> bool:
        """Renew once, in one request (not Prefect's retry loop, which waits minutes for a server that does not
        answer); whether the server confirmed it. A lease it no longer has: `gone` says so."""
        import httpx

        asked_at = time.monotonic()
        http = client._client
        try:
            request = http.build_request("POST", f"/v2/concurrency_limits/leases/{self.lease_id}/renew",
                                         json={"lease_duration": LEASE_S}, timeout=timeout)
            httpx.Client.send(http, request).raise_for_status()
        except httpx.HTTPStatusError as e:
            if e.response.status_code in (404, 410):
                self.gone = f"the Prefect server answered {e.response.status_code}: the lease expired or was revoked"
            return False
        except Exception:  # noqa: BLE001 - unreachable: retried, and judged by how long it lasts
            return False
        self.confirmed_at = max(self.confirmed_at, asked_at)
        return True

    def unconfirmed_s(self) -> float:
        return time.monotonic() - self.confirmed_at


_leases: contextvars.ContextVar[tuple[_Lease, ...]] = contextvars.ContextVar("smelter_leases", default=())


def raise_if_lease_lost() -> None:
    """A safe point before a write only a slot's holder may make (a store publication, a registry write): every
    slot this context holds must be proven still held. One whose renewals have not been confirmed for
    REPROVE_AFTER_S is renewed once more, at once; LeaseLost when the server does not confirm it, so the holder
    stops instead of writing beside whoever took the slot after the lease expired."""
    for lease in _leases.get():
        if not lease.gone and lease.unconfirmed_s() < REPROVE_AFTER_S:
            continue
        if not lease.gone:
            from prefect.client.orchestration import get_client

            with get_client(sync_client=True) as client:
                if lease.renew(client, timeout=REPROVE_TIMEOUT_S):
                    continue
        why = lease.gone or f"no renewal confirmed for {lease.unconfirmed_s():.0f} s (the lease is {LEASE_S} s)"
        raise LeaseLost(f"{lease.what}: lost slot {lease.name}: {why}; another holder may have it now, so this "
                        f"process stops before writing")


def _renew(lease: _Lease, stop: threading.Event) -> None:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        wait = RENEW_EVERY_S
        while not lease.gone and not stop.wait(wait):
            wait = RENEW_EVERY_S if lease.renew(client, timeout=RENEW_EVERY_S) else RETRY_RENEWAL_S


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
        try:
            record = SlotRecord.read(record_path)
        except UnreadableRecord as e:
            log.warning("%s", e)
            return
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
        lease = _acquire(client, name, what, record_path, temporary, wait)
        stop = threading.Event()
        renewer = threading.Thread(target=contextvars.copy_context().run, args=(_renew, lease, stop), daemon=True)
        renewer.start()
        token = _leases.set((*_leases.get(), lease))
        try:
            yield
        finally:
            _leases.reset(token)
            stop.set()
            renewer.join()
            if not lease.gone:  # a lease the server no longer has holds no slot; its record may be the next holder's
                _release(client, lease.lease_id, record_path)


@contextlib.contextmanager
def exclusive(what: str, scope: str) -> Iterator[None]:
    """Run the body alone among every process that asks for (`what`, `scope`): this host's, and other
    hosts' sharing the Prefect server. `scope` (e.g. the MLflow tracking URI) keeps unrelated stores apart."""
    slug = _slug(scope, what)
    with file_lock(_host_lock_dir() / f"{slug}.lock", what=what):
        if _prefect_reachable():
            with held_slot(f"smelter-{slug}", what):
                yield
        else:
            yield
