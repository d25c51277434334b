"""The tracking store smelter writes to, and the one way this package reaches it (`_client`).

MLflow's own configuration applies: MLFLOW_TRACKING_URI when set, else MLflow's default store. A
store is checked before any work (`store_problem`), since MLflow itself only fails at the first write.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

import mlflow
from mlflow.tracking import MlflowClient

from tasks import locks
from tasks.redact import redacted_url
from tasks.yaml_source import clip

HEALTH_TIMEOUT_S = 5.0
_initialised: set[str] = set()


def _client() -> MlflowClient:
    """A client on a store that is ready for concurrent use (see `init_store`)."""
    init_store()
    return MlflowClient()


def init_store() -> None:
    """Create or migrate the tracking store once, under a file lock beside a SQLite database.

    Two processes opening a fresh SQLite store at once both run MLflow's schema migration and one
    dies (`duplicate column name`); the first to hold the lock migrates, the other finds it done.
    """
    uri = mlflow.get_tracking_uri()
    if uri in _initialised:
        return
    if uri.startswith("sqlite:///"):
        database = Path(uri.removeprefix("sqlite:///").split("?")[0])
        with locks.file_lock(database.with_name(database.name + ".init.lock")):
            MlflowClient().search_experiments(max_results=1)
    _initialised.add(uri)


def tracking_uri() -> str:
    return mlflow.get_tracking_uri()


def shown_uri(uri: str) -> str:
    """A store URI as messages show it: redacted when it may hold a password (a server, user:pass@)."""
    try:
        parts = urlsplit(uri)
    except ValueError:
        return redacted_url(uri)
    return redacted_url(uri) if parts.scheme in ("http", "https") or "@" in parts.netloc else clip(uri)


def store_problem() -> str | None:
    """Why the tracking store MLFLOW_TRACKING_URI names cannot be used, or None; asked before any work,
    since MLflow itself only fails at the first write (a dead server after minutes of retries)."""
    from mlflow.tracking._tracking_service.utils import _tracking_store_registry

    uri = mlflow.get_tracking_uri()
    scheme, shown = urlsplit(uri).scheme, shown_uri(uri)
    try:
        _tracking_store_registry.get_store_builder(uri)
    except Exception:  # noqa: BLE001 - an unknown or malformed scheme, whichever way MLflow says it
        known = ", ".join(s for s in _tracking_store_registry._registry if s)
        return f"MLFLOW_TRACKING_URI {shown}: not a store MLflow can use; expected a path or one of {known}"
    if uri.startswith("sqlite:///"):
        database = Path(uri.removeprefix("sqlite:///").split("?")[0])
        if not database.parent.is_dir():
            return f"MLFLOW_TRACKING_URI {shown}: the directory of the database, {clip(str(database.parent))}, does not exist"
        try:
            init_store()
        except Exception as e:  # noqa: BLE001 - not a database, or one MLflow cannot migrate, whichever way it says it
            first_line = next(iter(str(e).strip().splitlines()), "")
            return f"MLFLOW_TRACKING_URI {shown}: MLflow cannot open this store ({type(e).__name__}: {clip(first_line)})"
    if scheme in ("http", "https"):
        import httpx

        try:
            httpx.get(f"{uri.rstrip('/')}/health", timeout=HEALTH_TIMEOUT_S)
        except httpx.HTTPError as e:
            return (f"MLFLOW_TRACKING_URI {shown}: the MLflow server does not answer ({type(e).__name__}); "
                    "start it, or point the variable at one")
    return None


def tracking_server() -> str | None:
    """The MLflow server's URL, or None when the client writes a store directly."""
    uri = mlflow.get_tracking_uri()
    return uri if urlsplit(uri).scheme in ("http", "https") else None
