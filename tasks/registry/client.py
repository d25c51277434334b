"""The tracking store smelter writes to, and the one way this package reaches it (`_client`).

MLflow's own configuration applies: MLFLOW_TRACKING_URI when set, else MLflow's default store. A
store is checked before any work (`store_problem`), since MLflow itself only fails at the first write.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import mlflow
from mlflow.tracking import MlflowClient

from tasks.config.yaml_source import clip
from tasks.runtime import locks
from tasks.runtime.redact import redacted_url
from tasks.runtime.server_health import unanswered

_initialised: set[str] = set()
_lost: dict[str, str] = {}  # server URI -> the line naming it, while it does not answer


def _client() -> MlflowClient:
    """A client on a store that is ready for concurrent use (see `init_store`), whose calls fail at once
    once its server is known to be gone (`_Watched`)."""
    _raise_if_lost()
    init_store()
    client = MlflowClient()
    return _Watched(client) if tracking_server() else client  # type: ignore[return-value]


def _raise_if_lost() -> None:
    """Once the server was found gone, each call asks its health again (a refused connection answers in a
    millisecond) instead of waiting out MLflow's retries: a server back up is used again."""
    uri = tracking_server()
    if uri in _lost:
        del _lost[uri]
        if (line := server_lost()) is not None:
            raise ServerLost(line)


class _Watched:
    """An MlflowClient on a server: a call that fails other than by the server's own answer (a RestException)
    asks the server's health; when it does not answer, this call and every later one raise `ServerLost` at
    once, instead of each waiting out MLflow's retries (MLFLOW_HTTP_REQUEST_MAX_RETRIES) to fail the same way."""

    def __init__(self, client: MlflowClient):
        self._client = client

    def __getattr__(self, name: str) -> Any:
        found = getattr(self._client, name)
        if not callable(found) or name.startswith("_"):
            return found

        @functools.wraps(found)
        def watched(*args: Any, **kwargs: Any) -> Any:
            _raise_if_lost()
            try:
                return found(*args, **kwargs)
            except Exception as e:
                _note_if_lost(e)
                raise
        return watched


def _note_if_lost(error: Exception) -> None:
    """Raise `ServerLost` (and remember it) when `error` came from a server that no longer answers."""
    from mlflow.exceptions import RestException

    if isinstance(error, (RestException, ServerLost)):
        return
    line = server_lost()
    if line:
        raise ServerLost(line) from error


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
    if scheme in ("http", "https") and (why := unanswered(uri)):
        return (f"MLFLOW_TRACKING_URI {shown}: the MLflow server does not answer ({why}); "
                "start it, or point the variable at one")
    return None


class ServerLost(Exception):
    """A server the run depends on stopped answering mid-run: the run ends with this one line, instead of
    each later call waiting out its retries and failing with its own traceback."""


def server_lost() -> str | None:
    """The line that ends a run whose MLflow server no longer answers, or None (it answers, or there is no
    server: a local store). Asked after a failure, so a dead server is named once rather than per call."""
    server = tracking_server()
    if server is None:
        return None
    if server not in _lost and (why := unanswered(server)):
        _lost[server] = (f"the MLflow server at {shown_uri(server)} (MLFLOW_TRACKING_URI) stopped answering mid-run "
                         f"({why}); finished stages are kept: start it again and run again "
                         "(MLFLOW_HTTP_REQUEST_MAX_RETRIES lengthens the wait for a restart)")
    return _lost.get(server)


def tracking_server() -> str | None:
    """The MLflow server's URL, or None when the client writes a store directly."""
    uri = mlflow.get_tracking_uri()
    return uri if urlsplit(uri).scheme in ("http", "https") else None
