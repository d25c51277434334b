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
import fcntl
import hashlib
import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path

LOCK_DIR_ENV = "SMELTER_LOCK_DIR"
PREFECT_LEASE_S = 60  # the least Prefect accepts: a killed holder blocks others this long at most (renewed while held)


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
def _prefect_limit(name: str) -> Iterator[None]:
    """One slot of the global concurrency limit `name` (created with one slot when missing)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.concurrency.sync import concurrency
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            client.read_global_concurrency_limit_by_name(name)
        except ObjectNotFound:
            with contextlib.suppress(ObjectAlreadyExists):
                client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))
    with concurrency(name, occupy=1, lease_duration=PREFECT_LEASE_S, strict=True):
        yield


@contextlib.contextmanager
def exclusive(what: str, scope: str) -> Iterator[None]:
    """Run the body alone among every process that asks for (`what`, `scope`): this host's, and other
    hosts' sharing the Prefect server. `scope` (e.g. the MLflow tracking URI) keeps unrelated stores apart."""
    slug = _slug(scope, what)
    with file_lock(_lock_dir() / f"{slug}.lock"):
        if _prefect_reachable():
            with _prefect_limit(f"smelter-{slug}"):
                yield
        else:
            yield
