"""Backend discovery tells a broken plugin from a user's Ctrl-C.

A plugin that fails to import is left out with a warning, so that the pipelines not using it still run. A
Ctrl-C that lands while a backend's module imports can come out of the import as a library's own error
(pydantic turns the KeyboardInterrupt raised inside its schema building into a SchemaError): the run must
stop then, not warn that a backend was ignored and carry on until the next Ctrl-C.
"""

from __future__ import annotations

import signal
from importlib.metadata import EntryPoint

import pytest

from tasks.backends import table
from tasks.runtime import stop_signals


@pytest.fixture
def broken_plugin(monkeypatch: pytest.MonkeyPatch) -> None:
    """One installed backend whose module raises an ordinary error when it loads."""
    broken = EntryPoint("broken", "json:NoSuchTarget", table.GROUP)
    monkeypatch.setattr(table, "entry_points", lambda group: [broken] if group == table.GROUP else [])
    monkeypatch.setattr(stop_signals, "received", [])


def test_a_plugin_that_cannot_load_is_left_out_with_a_warning(broken_plugin: None) -> None:
    with pytest.warns(UserWarning, match=r"backend broken of \? ignored: cannot load json:NoSuchTarget"):
        assert table.discover() == {}


def test_a_ctrl_c_that_became_a_plugins_load_error_stops_the_run(broken_plugin: None) -> None:
    stop_signals.received.append(signal.SIGINT)  # as smelter's handler records it before raising
    with pytest.raises(KeyboardInterrupt):
        table.discover()
