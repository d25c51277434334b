"""Locks that hold across processes: a file lock for this host, a Prefect global concurrency limit across hosts.

Promoting within one registered model (registering, deduplicating versions, recording events,
moving the alias, delivering) must not interleave between two runs. A file lock (`flock`) covers
processes of one host and is released by the kernel when its holder dies, so a killed run never
leaves a stale lock. When a Prefect API is reachable (inside a flow run, or PREFECT_API_URL set)
a global concurrency limit of one slot named `smelter-<what>` is held as well, which covers runs on
other hosts that share the Prefect server.
"""

from __future__ import annotations

import contextlib
import contextvars
import fcntl
import hashlib
import os
import re
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from uuid import UUID

LOCK_DIR_ENV = "SMELTER_LOCK_DIR"
PREFECT_LEASE_S = 60  # the least Prefect accepts: a holder killed on another host blocks others this long


def _lock_dir() -> Path:
    return Path(os.environ.get(LOCK_DIR_ENV) or Path(tempfile.gettempdir()) / "smelter-locks")


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive flock on `path` (created if missing); blocks until it is free."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _slug(scope: str, name: str) -> str:
    digest = hashlib.sha256(f"{scope}\0{name}".encode()).hexdigest()[:16]
    return f"{re.sub(r'[^A-Za-z0-9_.-]+', '-', name)[:80]}-{digest}"


def _prefect_reachable() -> bool:
    from prefect.context import FlowRunContext
    from prefect.settings import PREFECT_API_URL

    return FlowRunContext.get() is not None or bool(PREFECT_API_URL.value())


@contextlib.contextmanager
def _prefect_limit(name: str, leftover: Path) -> Iterator[None]:
    """One slot of the global concurrency limit `name` (created with one slot when missing), renewed while held.

    `leftover` names the lease this host holds. The caller holds the host's file lock, so a lease
    found there belongs to a process of this host that died holding it: it is released at once
    instead of blocking every run until it expires.
    """
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            client.read_global_concurrency_limit_by_name(name)
        except ObjectNotFound:
            with contextlib.suppress(ObjectAlreadyExists):
                client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))
        if leftover.exists():
            with contextlib.suppress(Exception):  # already expired or released
                client.release_concurrency_slots_with_lease(UUID(leftover.read_text().strip()))
            leftover.unlink(missing_ok=True)
        lease_id = _acquire(client, name)
        leftover.write_text(str(lease_id))
        stop = threading.Event()
        renewer = threading.Thread(target=contextvars.copy_context().run, args=(_renew, lease_id, stop), daemon=True)
        renewer.start()
        try:
            yield
        finally:
            stop.set()
            renewer.join()
            client.release_concurrency_slots_with_lease(lease_id)
            leftover.unlink(missing_ok=True)


def _acquire(client, name: str) -> UUID:
    """Wait for the slot; Prefect answers 423 with Retry-After while another holder has it."""
    import httpx

    while True:
        try:
            response = client.increment_concurrency_slots_with_lease([name], 1, "concurrency", PREFECT_LEASE_S)
        except httpx.HTTPStatusError as e:
            if e.response.status_code != 423:
                raise
            time.sleep(min(float(e.response.headers.get("Retry-After", "1")), 2.0))
            continue
        return UUID(response.json()["lease_id"])


def _renew(lease_id: UUID, stop: threading.Event) -> None:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        while not stop.wait(PREFECT_LEASE_S / 3):
            with contextlib.suppress(Exception):  # a missed renewal is retried; the lease outlives two misses
                client.renew_concurrency_lease(lease_id, PREFECT_LEASE_S)


@contextlib.contextmanager
def exclusive(what: str, scope: str) -> Iterator[None]:
    """Run the body alone among every process that asks for (`what`, `scope`): this host's, and other
    hosts' sharing the Prefect server. `scope` (e.g. the MLflow tracking URI) keeps unrelated stores apart."""
    slug = _slug(scope, what)
    with file_lock(_lock_dir() / f"{slug}.lock"):
        if _prefect_reachable():
            with _prefect_limit(f"smelter-{slug}", _lock_dir() / f"{slug}.lease"):
                yield
        else:
            yield
