"""Shared fixtures: tiny models, a real mlflow server, a webhook receiver and one Prefect server."""

from __future__ import annotations

import os
import signal
import tempfile
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.fixtures.fleet import PrefectApi

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Each pytest-xdist worker has its own servers and stores; its own lock records too, so that one worker's
# runs never wait on (or report) another's file locks on this host.
os.environ.setdefault("SMELTER_LOCK_DIR", tempfile.mkdtemp(prefix=f"smelter-locks-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}-"))

# A suite started in the background of a non-interactive shell (`make test &`, a CI step run so) inherits
# SIGINT ignored, and so would every run it starts: the Ctrl-C tests, which send SIGINT as a terminal does,
# would then test nothing. Give SIGINT its default back; the runs started from here inherit that.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

pytest_plugins = ["tests.fixtures.models", "tests.fixtures.servers", "tests.fixtures.fleet"]


def pytest_collection(session: pytest.Session) -> None:
    """A process that runs tests loads them with the cycle collector held off, as the `smelter` command loads
    (tasks/runtime/collector.py), and freezes what they loaded: a pytest process keeps it all to the end, and
    the collections its tests trigger then skip it (test_promote, test_inputs_families, test_spec and
    test_decide in one process: 34-36 CPU-s against 44). pytest-xdist's controller collects nothing: its
    own hook answers first, and this one does not run there."""
    from tasks.runtime import collector

    collector.hold()


def pytest_collection_finish(session: pytest.Session) -> None:
    from tasks.runtime import collector

    collector.loaded()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked `waits` go first. pytest-xdist gives the front of the list to one worker and steals from the
    back, so one worker waits out their clocks while the others keep the cores busy; last, one worker would wait
    alone at the end of the suite (the two lease tests' 2.5 minutes did)."""
    items.sort(key=lambda item: item.get_closest_marker("waits") is None)


@pytest.fixture(scope="session")
def prefect_server(prefect_api: PrefectApi) -> Iterator[None]:
    """The session's one real Prefect server (tests/fixtures/fleet.py) as the API of the flows this process runs
    (started only by tests that run flows), its database as this process's server database (a UI server reads
    it). One server, not a second one for them: a Prefect server costs 9 s of CPU to start on a new database
    and about 2 s a minute while it idles."""
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_DATABASE_CONNECTION_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: prefect_api.url,
                                     PREFECT_SERVER_DATABASE_CONNECTION_URL: prefect_api.database}):
        yield


@pytest.fixture(autouse=True)
def _tracking_store_kept() -> Iterator[None]:
    """A test that changes the session's MLFLOW_TRACKING_URI for good would silently send every later
    test to another store; fail that test instead."""
    before = os.environ.get("MLFLOW_TRACKING_URI")
    yield
    if before is not None:
        assert os.environ.get("MLFLOW_TRACKING_URI") == before, "this test left MLFLOW_TRACKING_URI changed"
